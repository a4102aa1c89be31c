"""Everything that turns a model and prompts into new tokens, in one package.

- :mod:`.sampling`: :class:`SamplingConfig`, what distribution to draw from (validated in one place,
  turned into ``generate`` arguments in one place; no torch, so option parsers use it).
- :mod:`.kv_decode`: the token-by-token KV-cache decoder that samples from ``generate``'s distribution
  (its very tokens with ``draw="multinomial"``), the draws, and the positions that skip left padding.
- :mod:`.plain`: :class:`PlainGenerator`, that decoder on the training module.
- :mod:`.stops`: the stop ids of a rollout and the masks they cut (pure torch; the PPO maths uses them).
- :mod:`.inference_copy` and :mod:`.hybrid`: the hybrid engine (a plain, optionally tensor-parallel copy
  of the actor refilled each PPO round; the ZeRO-3 gathering is passed in by ``dschat.engine``);
  :mod:`.attention`: its fp32 SDPA and KV cache for bf16 on CPU.
- :mod:`.texts`: prompts in, completion texts out (evaluation, on-policy pairs).
- :mod:`.decoding`: the inference tools' strategies (greedy, sampling, beam, contrastive search).
- :mod:`.streaming`: a reply as it is generated, cut at an invented turn.

The package imports no DeepSpeed and nothing from ``dschat.engine``, ``dschat.rlhf`` or ``dschat.tasks``.
"""
