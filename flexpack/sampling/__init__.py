"""Flow-matching sampling of a trained WanVA on packed (episode, cut point) pairs.

Layer rule: sampling may import packing, attention, models, data and training's objective, noise,
build, checkpoint, export and resume; nothing under packing/attention/models/data/training imports
sampling except training's loop (and tracking) for the in-training hook.
"""
