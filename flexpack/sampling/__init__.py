"""Flow-matching sampling of a trained model (any family: its sampler, the flow solver by default) on packed
(episode, cut point) pairs.

Layer rule (``tests/test_layers.py``): sampling may import packing, attention, models, data and, of
training, only objective, noise, build, checkpoint, export, resume, checks, config, holdout and
parallel; of the other wings only training's loop imports sampling (the ``sample.every`` hook).
"""
