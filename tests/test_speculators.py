"""The speculator: prompt lookup against hand-worked histories, dual_token's accept/fallback rule, counting."""

from __future__ import annotations

from dd_sglang.prefetch import speculators
from dd_sglang.prefetch.speculators import DualTokenSpeculator, SpecState, ngram_propose, verify


def test_one_speculator_is_left():
    """``ngram`` and ``none`` as speculators of their own were measured worse and deleted: prompt lookup
    survives only as ``dual_token``'s fallback."""
    assert DualTokenSpeculator.name == "dual_token"
    assert not any(hasattr(speculators, n) for n in ("NgramSpeculator", "NoSpeculator", "SPECULATORS", "make_speculator"))


def test_ngram_takes_the_longest_recurring_suffix_most_recent_first():
    # ... 5 6 7 [8] ... 9 6 7 [1] ... 6 7 -> the trigram "x 6 7" does not recur; the bigram "6 7"
    # last occurred before 1.
    h = [5, 6, 7, 8, 2, 9, 6, 7, 1, 3, 6, 7]
    assert ngram_propose(h, SpecState()) == 1
    # Trigram wins over a more recent bigram: "9 6 7" was followed by 1, "6 7" more recently by 4.
    h = [9, 6, 7, 1, 6, 7, 4, 9, 6, 7]
    assert ngram_propose(h, SpecState()) == 1


def test_ngram_none_without_recurrence_and_incremental_index():
    st = SpecState()
    assert ngram_propose([1, 2, 3], st) is None
    assert st.indexed == 3
    # Growing the same history reuses the index; result equals a fresh computation.
    h = [1, 2, 3, 4, 2]
    assert ngram_propose(h, st) == 3 == ngram_propose(h, SpecState())


def test_dual_token_uses_the_argmax_only_after_an_accepted_speculation():
    spec = DualTokenSpeculator()
    accepted = SpecState(riding=(42,), top=[(77, 0.5, 78, 0.3)], branch=0)
    assert spec.propose([1, 2, 42], accepted) == (77,)  # 42 rode along and was real

    def rejected():
        return SpecState(riding=(41,), top=[(77, 0.5, 78, 0.3)], branch=None)

    assert spec.propose([5, 9, 1, 5, 42], rejected()) == ()  # rejected, no n-gram
    assert spec.propose([5, 9, 1, 5], rejected()) == (9,)  # rejected: prompt lookup
    assert spec.propose([5, 9, 1, 5], SpecState()) == (9,)  # first sparse step: prompt lookup


def test_dual_token_rides_one_token_however_unsure_its_argmax():
    """The runner-up never rides (``experimental.branches`` is gone: measured worse)."""
    unsure = SpecState(riding=(42,), top=[(77, 0.3, 78, 0.29)], branch=0)
    assert DualTokenSpeculator().propose([1, 42], unsure) == (77,)


def test_verify_finds_the_riding_token_that_was_real_and_counts():
    st = SpecState()
    assert verify(st, 5) is None and st.proposed == 0 and st.branch is None
    st.riding = (5,)
    assert verify(st, 5) is True and st.branch == 0
    st.riding = (6, 5)
    assert verify(st, 5) is True and st.branch == 1
    st.riding = (6,)
    assert verify(st, 5) is False and st.branch is None
    assert (st.proposed, st.accepted) == (3, 2)
