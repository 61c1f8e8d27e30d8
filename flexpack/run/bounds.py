"""What one flag or config key may ask for: the ranges of the counts of sampling, checked before any work.

A count is checked where it is given (``flexpack sample``'s flags before the config is read,
``sample.*`` when the config is loaded): a value out of range is one line naming the flag or
key and the range, exit status 2, never a run that grows until the machine gives out or fails after
training. The upper bounds are far above any real use and low enough that one value cannot cost
more than hours:

- solver steps (``sample --steps``, ``sample.steps``): 1 to 10,000; 10 to 100 is usual, and
  10,000 Euler steps of a 5B model take hours per pack;
- cut points per episode (``--cuts``, ``sample.cuts``): 1 to 1,000;
- explicit cut points (``--cut-points``): at most 1,000 of them, each 1 to 10,000 latent frames;
- horizon (``--horizon``, ``sample.horizon`` where 0 means the default): 1 to 10,000 latent
  frames per cut or rollout stage (40,000 video frames at stride 4);
- held-out episodes sampled during training (``sample.episodes``): 1 to 100,000;
- plots (``--plots``, ``sample.plots``): 0 to 1,000 episodes;
- noise seed (``--seed``): 0 to 2^32 - 1; the noise draw keeps 32 bits of it, so a larger seed would
  repeat a smaller one's noise.
"""

from __future__ import annotations

from typing import Any

from flexpack.errors import UserError

SOLVER_STEPS = 10_000
CUTS = 1_000
HORIZON = 10_000
EPISODES = 100_000
PLOTS = 1_000
SAMPLES = 1_000  # forecasts per (episode, cut point)
SEED = 2**32 - 1


def check_count(name: str, value: Any, low: int, high: int, *, unit: str = "") -> int:
    """``value`` if it is an integer in ``[low, high]``; else one line naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{name} must be an integer from {low:,} to {high:,}{f' ({unit})' if unit else ''}, "
                        f"got {value!r}")
    return value
