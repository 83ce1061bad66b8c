"""``python -m dd_sglang.models prepare|path|clean``: manage the embedded model cache."""

from __future__ import annotations

import argparse
import shutil
import sys

from dd_sglang.models.smollm2 import ModelError, cache_root, model_dir, prepare_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dd_sglang.models", description=__doc__)
    ap.add_argument("command", choices=["prepare", "path", "clean"])
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    if args.command == "path":
        print(model_dir())
        return 0
    if args.command == "clean":
        shutil.rmtree(model_dir(), ignore_errors=True)
        (cache_root() / ".convert.lock").unlink(missing_ok=True)
        print(f"removed {model_dir()}")
        return 0
    try:
        path = prepare_model(progress=not args.quiet)
    except ModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no model was written (the next run starts over)", file=sys.stderr)
        return 130
    print(f"embedded model ready: {path} (cache: {cache_root()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
