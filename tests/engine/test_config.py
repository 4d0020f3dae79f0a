"""EngineConfig's compiled step shapes."""

from jaxllm.engine.config import EngineConfig


def test_default_buckets_are_powers_of_two_up_to_the_budget():
    assert EngineConfig(max_num_batched_tokens=100, max_num_seqs=64).buckets() == [
        (1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (32, 32), (64, 64), (100, 64)]


def test_a_smaller_budget_over_a_presets_buckets_drops_those_it_never_fills():
    preset = EngineConfig.from_preset("smollm2-cpu")
    tokens = [t for t, _ in preset.buckets()]
    assert tokens[-1] == preset.max_num_batched_tokens and 160 in tokens  # between the powers of two
    small = EngineConfig.from_preset("smollm2-cpu", max_num_batched_tokens=100, max_num_seqs=16)
    assert small.buckets() == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (32, 16), (48, 16), (64, 16), (96, 16),
                               (128, 16)]
