"""Building and loading the CPU kernels' library (``cpu_select.c``) with the system C compiler.

The kernels themselves (their Python entry points, checks and threading) are in
:mod:`dd_sglang.kernels.native`, which re-exports this module's public names.

**Build.** ``cc -O3 -march=native -fPIC -shared -fopenmp`` (the compiler from ``$CC``, else ``cc``)
into ``$DD_SGLANG_CACHE/native/`` (default ``~/.cache/dd_sglang``), once per source, flags
and CPU (the file name carries a hash of the three), written to a temporary name and
renamed, so concurrent processes never load a half-written library. ``-march=native``: the
library is built on the machine that runs it, for its instruction set (AVX2 or AVX-512).
Without a compiler, or if the build fails, :func:`load` returns None and logs why once; the
selector then uses its PyTorch path (``experimental.kernel: auto``).

Imports no other dd_sglang layer.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("dd_sglang.kernels.native")

SOURCE = Path(__file__).with_name("cpu_select.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp")
#: ``MAXG`` and ``MAXD`` of ``cpu_select.c``: query vectors per row (KV heads x group x riding
#: positions) and head_dim it takes.
MAX_QUERIES, MAX_HEAD_DIM = 64, 256

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why = ""


class NativeUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here (the message says why)."""


def _cache_dir() -> Path:
    env = os.environ.get("DD_SGLANG_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "dd_sglang") / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(cache: Path | None = None, march: str = "native", source: Path = SOURCE) -> Path:
    """Compile ``cpu_select.c`` (once per source, flags and CPU) and return the library's path.

    ``march``: the ``-march`` target (tests build ``haswell`` and ``x86-64`` too, to check the
    AVX2 and plain-C paths a machine without AVX-512 runs). ``source``: another version of the
    file (``bench.select_kernel --baseline-rev`` times an earlier commit's against this one).

    Raises:
        NativeUnavailable: no C compiler (``$CC`` or ``cc``), or the compiler failed (its
            message is included).
    """
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise NativeUnavailable(f"no C compiler ({cc!r} not on PATH)")
    src = source.read_bytes()
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)
    key = hashlib.sha256(src + " ".join(flags).encode() + cc.encode() + _cpu_flags().encode()).hexdigest()[:16]
    out_dir = cache or _cache_dir()
    lib = out_dir / f"cpu_select-{key}.so"
    if lib.exists():
        return lib
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise NativeUnavailable(f"cannot create {out_dir} ({err})") from None
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        if proc.returncode != 0:
            raise NativeUnavailable(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[:2000]}")
        os.replace(tmp, lib)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NativeUnavailable(f"{cc} could not build the kernel ({err})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load(path: Path | None = None) -> ctypes.CDLL | None:
    """The loaded kernel, built on first call; None (logged once, with the reason) where it cannot be.

    ``path``: load this library instead (a test switching to a build for another ``-march``);
    it replaces the one loaded before.
    """
    global _lib, _tried, _why
    with _lock:
        if _tried and path is None:
            return _lib
        _tried = True
        try:
            lib = ctypes.CDLL(str(path or build()))
        except (NativeUnavailable, OSError) as err:
            _why = str(err)
            log.warning("dd_sglang: CPU selection kernel unavailable, using PyTorch: %s", err)
            return None
        _declare_signatures(lib)
        _lib = lib
        return _lib


def _declare_signatures(lib: ctypes.CDLL) -> None:
    """Set the ctypes argument and result types of every ``dd_`` entry point of ``cpu_select.c`` (those
    added since a bench's ``--baseline-rev`` only where the library has them)."""
    i, p, i64, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    head = [i, i, i, i, i, i, i64, p, p, p, p, p, p, i, i, i, f, p, p, p, p, i]
    lib.dd_spec_host_select.argtypes = [*head, i, i]
    lib.dd_spec_host_select_par.argtypes = [*head, i]
    lib.dd_spec_host_select.restype = lib.dd_spec_host_select_par.restype = ctypes.c_int
    lib.dd_quantize_keys.argtypes = [i, i64, i, i, p, i, p, i64, p, p, i]
    lib.dd_quantize_keys.restype = ctypes.c_int
    lib.dd_gather_rows.argtypes = [p, p, p, p, p, p, i64, i64, i]
    lib.dd_gather_rows.restype = None
    lib.dd_copy_rows.argtypes = [p, p, p, p, i64, i64]
    lib.dd_copy_rows.restype = None
    if hasattr(lib, "dd_gather_sets"):  # absent from a library built of an older cpu_select.c (--baseline-rev)
        lib.dd_gather_sets.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i]
        lib.dd_gather_sets.restype = None
    lib.dd_sparse_attend.argtypes = [i, i, i, i, i, i, i64, p, i64, p, p, p, p, p, i64, p, i, i, f, p, p, p, i, p, p,
                                     p, i, i, i]  # fmt: skip
    lib.dd_sparse_attend.restype = ctypes.c_int
    lib.dd_measure.argtypes = [i, i, i, i, i, i, p, p, p, p, i, p, p, f, p, p, p, i]
    lib.dd_measure.restype = ctypes.c_int


def available() -> bool:
    """Whether the kernel is (or can be) loaded here."""
    return load() is not None


def unavailable_reason() -> str:
    """Why :func:`load` returned None ("" when it did not, or was not yet called)."""
    return _why
