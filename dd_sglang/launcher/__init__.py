"""The pieces of ``python -m dd_sglang.launch_server`` (the order it runs them in is that module's docstring):
:mod:`~dd_sglang.launcher.sglang_argv` (SGLang's command line), :mod:`~dd_sglang.launcher.startup_checks`
(the refusals before anything starts), :mod:`~dd_sglang.launcher.supervision` (SGLang's process group and
the metrics sidecar)."""
