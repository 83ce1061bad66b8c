"""``bench.machine``: the machine-state probe every speed benchmark records in its JSON."""

from __future__ import annotations

import pytest
import torch

from bench import machine


def test_machine_state_times_both_dtypes_on_this_threads_count():
    state = machine.machine_state(calls=3)
    assert state["intra_op_threads"] == torch.get_num_threads()
    ms = state["sdpa_decode_ms"]
    assert set(ms) == {"bfloat16", "float32"}
    assert all(0 < v < 10_000 for v in ms.values())
    line = machine.summary(state)
    assert f"{ms['bfloat16']} ms bfloat16" in line and f"{ms['float32']} ms float32" in line


def test_describe_keeps_both_states():
    before, after = {"sdpa_decode_ms": {"bfloat16": 1.0}}, {"sdpa_decode_ms": {"bfloat16": 2.0}}
    out = machine.describe(before, after)
    assert out["state_before"] is before and out["state_after"] is after and out["cpus"] >= 1
    assert "state_after" not in machine.describe(before)
    assert set(out) >= {"cpu_model", "bf16_isa"} and set(out["bf16_isa"]) <= {"avx512_bf16", "amx_bf16"}


def test_cpu_model_reads_vendor_and_model_name_of_the_first_cpu(tmp_path):
    from dd_sglang.platform.dtype import cpu_model

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
                    "\nprocessor\t: 1\nvendor_id\t: Other\nmodel name\t: Other CPU\n")  # fmt: skip
    assert cpu_model(str(info)) == "GenuineIntel Intel(R) Xeon(R) Platinum 8481C"
    assert cpu_model(str(tmp_path / "missing")) == ""


@pytest.mark.parametrize("calls, keys", [(0, 10), (1, 0)])
def test_a_bad_probe_size_names_it(calls, keys):
    with pytest.raises(ValueError, match="calls and keys must be >= 1"):
        machine.sdpa_decode_ms(torch.float32, calls=calls, keys=keys)
