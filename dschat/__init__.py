"""dschat: supervised fine-tuning, reward modelling and PPO on DeepSpeed (DeepSpeed-Chat's three steps)."""

__version__ = "0.1.0"

import os as _os

# CPU ranks stay on the CPU. DeepSpeed's launcher, starting ranks with its CPU accelerator, sets
# CUDA_VISIBLE_DEVICES=0,1,... for them, which shows GPUs hidden from train.py again (rank 1 of a one-GPU
# machine then asks for GPU 1: "invalid device ordinal"). DS_ACCELERATOR=cpu (train.py's launcher sets it
# for one node's CPU ranks: dschat.launch.launcher.launcher_env) hides them here, before anything asks
# torch for CUDA.
if _os.environ.get("DS_ACCELERATOR") == "cpu" and _os.environ.get("CUDA_VISIBLE_DEVICES"):
    _os.environ["CUDA_VISIBLE_DEVICES"] = ""
