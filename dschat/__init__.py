"""dschat: supervised fine-tuning, reward modelling and PPO on DeepSpeed (DeepSpeed-Chat's three steps)."""

__version__ = "0.1.0"
