"""RLHF (step 3): pure PPO maths, the Experience container, generation and reward interfaces, the trainer."""
