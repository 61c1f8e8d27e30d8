"""The substrate every command needs: config, the composition root, build, pretrained weights,
held-out split, checks, in-memory data and run state (``state/``)."""
