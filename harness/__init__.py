"""The harness the tests and the benchmarks share: real servers started and stopped
(:mod:`harness.server`), HTTP clients and the presets they run (:mod:`harness.client`), teacher
forcing (:mod:`harness.teacher_force`), prompts (:mod:`harness.prompts`, :mod:`harness.texts`).

``tests/`` and ``bench/`` import it; it imports ``dd_sglang`` and nothing of either (a test needs
no benchmark to start a server, and a benchmark none of the suite).
"""
