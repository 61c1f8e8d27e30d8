import os

# Tests never reach a hub: datasets are built locally, models are small and random.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
