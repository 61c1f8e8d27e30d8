import pytest

from flexpack.models import wan_config
from flexpack.packing.layout import SequenceLayout
from flexpack.training.flops import batch_flops, episode_flops


def test_episode_flops_counts_weights_on_tokens_and_unmasked_pairs_only():
    cfg = wan_config("tiny", num_layers=1, action_channels=0)  # dim 64, ffn 128, in 4, text 32
    D, Fd = 64, 128
    per_token = 4 * D * D + 2 * D * D + 2 * D * Fd + 4 * 4 * D + D * 4 * 4
    per_text = 2 * D * D + 32 * D + D * D
    got = episode_flops(cfg, [10, 6], [3, 5])
    want = 3 * 2 * (per_token * 16 + per_text * 8) + 3.5 * 4 * D * (10 * 10 + 6 * 6 + 10 * 3 + 6 * 5)
    assert got == pytest.approx(want, rel=1e-12)
    # packing two episodes costs the sum of their parts (no cross-episode pairs)
    assert got == pytest.approx(episode_flops(cfg, [10], [3]) + episode_flops(cfg, [6], [5]), rel=1e-12)


def test_batch_flops_ignores_padding():
    cfg = wan_config("tiny", num_layers=2, action_channels=0)
    lay = SequenceLayout.from_rows([[3, 2]], 9)  # 4 pad frames
    assert batch_flops(cfg, lay, 4, 7) == pytest.approx(episode_flops(cfg, [12, 8], [7, 7]))
