"""dschat.memory against values computed by hand for a small config, and parameter counts against the
models transformers builds (on the meta device: no memory, no weights)."""

from __future__ import annotations

import pytest

from dschat import memory as M
from dschat import planning as P
from dschat.models import shapes as S
from dschat.utils.errors import UserError

# A small Llama-style config worked through by hand below: vocab 100, hidden 8, 2 layers, 2 query heads
# and 1 key/value head of size 4, SwiGLU MLP of 16, untied head.
SMALL = {"model_type": "llama", "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip


@pytest.fixture
def small() -> S.ModelShape:
    return S.shape_from_config(SMALL)


def test_parameter_counts_by_hand(small):
    # per layer: q 8x8=64, k 8x4=32, v 32, o 64, gate/up/down 3 x 128 = 384, two RMSNorms 16 -> 592
    assert small.layer_params() == 592
    # embedding 800 + 2 layers 1184 + final norm 8 + LM head 800
    assert small.parameters("lm") == 2792
    # a reward model replaces the LM head by one output: 800 + 1184 + 8 + 8
    assert small.parameters("score") == 2000
    assert small.largest_layer_params() == 800  # the embedding
    # LoRA rank 2 on all 7 Linears: 2 x (16 + 12 + 12 + 16 + 24 + 24 + 24) = 256 per layer
    assert small.lora_params(2) == 512


def test_model_states_by_hand_bf16(small):
    p, largest = small.parameters(), small.largest_layer_params()
    hw = dict(gpus_per_node=2, nodes=2)  # N = 4 devices

    def states(stage, offload):
        return M.trained_states(p, largest, M.Choice(stage, offload, False), 2, **hw)

    assert states(0, False) == (33504, 20 * 2792)  # cpu: 2792 x 4 bytes x 2 GPUs x 1.5 while loading
    assert states(2, False) == (33504, 2 * 2792 + 18 * 2792 // 4)  # 5584 + 12564
    # ZeRO-1 does not partition gradients (DeepSpeed partitions them only at stage 2): the whole bf16
    # gradient, 2 x 2792, instead of its quarter
    assert states(1, False) == (33504, 2 * 2792 + 18 * 2792 // 4 + 2 * 2792 - 2 * 2792 // 4)
    assert states(2, True) == (67008, 5584)  # cpu: 2792 x max(4 x 4, 16) x 1.5
    assert states(3, False) == (9600, 4 * 800 + 18 * 2792 // 4)  # cpu: largest layer x 4 x 2 x 1.5
    assert states(3, True) == (37692, 3200)  # cpu: 2792 x 18 / 2 nodes x 1.5


def test_model_states_by_hand_fp32(small):
    p, largest = small.parameters(), small.largest_layer_params()

    def dev(stage):
        return M.trained_states(p, largest, M.Choice(stage, False, False), 4, 2, 2)[1]

    assert dev(0) == 16 * 2792  # params 4 + grads 4 + Adam 8
    # ZeRO-2: params 4, then partitioned grads 4, master copy 4 (DeepSpeed clones it in fp32 too), Adam 8
    assert dev(2) == 4 * 2792 + 16 * 2792 // 4
    assert dev(1) == dev(2) + 4 * 2792 - 4 * 2792 // 4  # ZeRO-1: the whole fp32 gradient
    assert dev(3) == 3200 + 16 * 2792 // 4


def test_frozen_states(small):
    p, largest = small.parameters(), small.largest_layer_params()
    assert M.frozen_states(p, largest, 0, False, 2, 2, 2) == (0, 2 * 2792)
    assert M.frozen_states(p, largest, 3, False, 2, 2, 2) == (0, 2 * 800 + 2 * 2792 // 4)
    assert M.frozen_states(p, largest, 3, True, 2, 2, 2) == (int(2792 * 2 / 2 * 1.5), 2 * 800)


def test_activations_by_hand(small):
    # per token and layer: 4h + 2q + 2kv + 4f = 32 + 16 + 8 + 64 = 120 values; b=2, s=3, bf16
    assert M.layer_activation_bytes(small, 2, 3, 2) == 2 * 2 * 3 * 120
    final_norm = 2 * 2 * 2 * 3 * 8
    logits = 2 * 3 * 100 * (2 + 4 + 4)
    assert M.activation_bytes(small, 2, 3, 2, checkpointing=False) == 2 * 1440 + final_norm + logits
    # checkpointing keeps each layer's input (2 x 2*2*3*8) and recomputes one layer at a time
    assert M.activation_bytes(small, 2, 3, 2, checkpointing=True) == 2 * 96 + 1440 + final_norm + logits
    # fp32: no separate fp32 copy of the logits
    assert M.logits_bytes(small, 2, 3, 4) == 2 * 3 * 100 * 8
    # keys and values: 2 x layers x b x s x kv_dim x bytes
    assert M.kv_cache_bytes(small, 2, 3, 2) == 2 * 2 * 2 * 3 * 4 * 2


def test_train_estimate_adds_its_parts(small):
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=10 * M.GIB)
    work = M.TrainWorkload(small, batch=2, seq=3, dtype_bytes=2)
    e = M.estimate_train(work, M.Choice(0, False, False), hw)
    assert e.parts == {"model states": 20 * 2792, "activations": 9072, "runtime": M.GPU_RUNTIME_BYTES}
    assert e.device == sum(e.parts.values())
    # a reward model sees chosen and rejected together: activations of 2b sequences, no vocabulary logits;
    # its head computes in fp32 from a kept fp32 copy of the last hidden states (4 bytes x 4 x 3 x 8)
    rm = M.estimate_train(
        M.TrainWorkload(small, 2, 3, 2, head="score", pairs=True), M.Choice(0, False, False), hw
    )
    assert (
        rm.parts["activations"]
        == 2 * M.layer_activation_bytes(small, 4, 3, 2) + 2 * 2 * 4 * 3 * 8 + 4 * 4 * 3 + 4 * 4 * 3 * 8
    )


def test_dpo_estimate_counts_both_answers_with_logits_and_a_separate_reference(small):
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=10 * M.GIB)
    c0 = M.Choice(0, False, False)
    dpo = M.estimate_train(M.TrainWorkload(small, 2, 3, 2, pairs=True), c0, hw)
    sft = M.estimate_train(M.TrainWorkload(small, 2, 3, 2), c0, hw)
    # the policy keeps its LM head and sees chosen and rejected: step 1's activations of 2b = 4 sequences
    assert dpo.parts["activations"] == M.activation_bytes(small, 4, 3, 2, checkpointing=False)
    assert dpo.parts["model states"] == sft.parts["model states"] == 20 * 2792
    # a reference 10x wider than the policy: its bf16 weights plus one no-grad forward of the 4 sequences
    # outweigh training's activations, and the estimate says so
    wide = S.shape_from_config({**SMALL, "hidden_size": 80, "intermediate_size": 160, "num_attention_heads": 2,
                                "num_key_value_heads": 1})  # fmt: skip
    with_ref = M.estimate_train(M.TrainWorkload(small, 2, 3, 2, pairs=True, reference=wide), c0, hw)
    ref = wide.parameters("lm") * 2 + M.forward_only_bytes(wide, 4, 3, 2)
    assert ref > dpo.parts["activations"]
    assert with_ref.parts == {
        "model states": 20 * 2792,
        "reference pass": ref,
        "runtime": M.GPU_RUNTIME_BYTES,
    }


def test_make_plan_reads_dpo_options():
    from dschat.config import DataArgs, DeepSpeedArgs, DPOArgs, LoraArgs, ModelArgs, OptimArgs, RunArgs

    hw = M.Hardware(gpus_per_node=1, on_gpu=False, cpu_node_bytes=8 * M.GIB)

    def groups(ref):
        return (ModelArgs(model_name_or_path="builtin:micro-llama"), DataArgs(max_seq_len=64), LoraArgs(),
                OptimArgs(per_device_train_batch_size=4), DeepSpeedArgs(), RunArgs(),
                DPOArgs(ref_model_name_or_path=ref))  # fmt: skip

    plan = P.make_plan(2, groups(None), [], hw)
    assert (plan.workload.head, plan.workload.pairs, plan.workload.reference) == ("lm", True, None)
    assert [m[0] for m in plan.models] == ["model"]
    text = P.format_plan(plan, full=False)
    assert text.startswith("step 2 (DPO)") and "micro-batch 4 pairs (chosen + rejected) x 64" in text
    plan = P.make_plan(2, groups("builtin:tiny-llama"), [], hw)
    assert [m[0] for m in plan.models] == ["model", "reference"]
    assert plan.workload.reference.hidden_size == 256  # the tiny preset: 256 wide
    # step 2's reward model (no DPO options): a scalar head over pairs
    rm = P.make_plan(2, groups(None)[:-1], [], hw)
    assert (rm.workload.head, rm.workload.pairs) == ("score", True)
    assert P.format_plan(rm, full=False).startswith("step 2 (reward model)")


def test_lora_only_trains_the_adapter(small):
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)
    work = M.TrainWorkload(small, 2, 3, 2, lora_dim=2, only_lora=True)
    e = M.estimate_train(work, M.Choice(0, False, False), hw)
    assert e.parts["model states"] == 20 * 512 + 2 * 2792  # adapter fully trained, base frozen in bf16


def test_trainable_layers_count_states_and_activations_of_the_top_layers_only(small):
    """--trainable_layers 1 of 2 (freeze_below): the top layer and the final norm train, the embeddings,
    the LM head and the bottom layer are frozen (16-bit weights only), and only the top layer keeps
    activations for the backward pass."""
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)
    e = M.estimate_train(M.TrainWorkload(small, 2, 3, 2, trainable_layers=1), M.Choice(0, False, False), hw)
    trained = 592 + 8  # one layer + the final RMSNorm
    assert e.parts["model states"] == 20 * trained + 2 * (2792 - trained)
    layer = M.layer_activation_bytes(small, 2, 3, 2)
    assert e.parts["activations"] == 9072 - layer  # one of the two layers' activations
    # a reward model: its score head (8) trains too
    rm = M.estimate_train(
        M.TrainWorkload(small, 2, 3, 2, head="score", trainable_layers=1), M.Choice(0, False, False), hw
    )
    assert rm.parts["model states"] == 20 * (trained + 8) + 2 * (2000 - trained - 8)
    # step 3: the actor's and the critic's own K
    work = M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, actor_trainable_layers=1, critic_trainable_layers=2)
    r = M.estimate_rlhf(work, M.Choice(0, False, False), hw)
    # K = every layer still freezes the embeddings (freeze_below): 800 frozen, the rest trains
    assert r.parts["actor states"] == e.parts["model states"]
    assert r.parts["critic states"] == 20 * (2 * 592 + 8 + 8) + 2 * 800


def test_rlhf_estimate_counts_four_models_and_the_largest_phase(small):
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)
    work = M.RLHFWorkload(small, small, generation_batch=4, training_batch=2, prompt_len=2, answer_len=1,
                          dtype_bytes=2)  # fmt: skip
    e = M.estimate_rlhf(work, M.Choice(0, False, False), hw)
    assert e.parts["actor states"] == 20 * 2792 and e.parts["critic states"] == 20 * 2000
    assert e.parts["reference"] == 2 * 2792 and e.parts["reward model"] == 2 * 2000
    phases = [
        M.kv_cache_bytes(small, 4, 3, 2),
        M.forward_only_bytes(small, 4, 3, 2, entropy=True),
        M.activation_bytes(small, 2, 3, 2, False, "lm"),
        M.activation_bytes(small, 2, 3, 2, False, "score"),
    ]
    [value] = [v for k, v in e.parts.items() if k.startswith("activations")]
    assert value == max(phases)
    shared = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, reference=False, reward_model=False),
                             M.Choice(0, False, False), hw)  # fmt: skip
    assert "reference" not in shared.parts and "reward model" not in shared.parts
    # --offload_reference_model under ZeRO-3: the reference keeps only its largest layer on the device
    z3 = M.Choice(3, False, False)
    kept = M.estimate_rlhf(work, z3, hw)
    moved = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, offload_reference=True), z3, hw)
    assert kept.parts["reference"] == 2 * 800 + 2 * 2792 and moved.parts["reference"] == 2 * 800
    assert moved.cpu_node == kept.cpu_node + int(2792 * 2 * 1.5)


def test_a_reward_model_of_its_own_is_counted_with_its_own_shape(small):
    """--reward_model_name_or_path: the frozen reward model is that model, not one of the critic's
    shape (4 layers here: 800 + 4 x 592 + 8 + 8 score parameters in 16 bits)."""
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)
    deeper = S.shape_from_config({**SMALL, "num_hidden_layers": 4})
    e = M.estimate_rlhf(
        M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, reward=deeper), M.Choice(0, False, False), hw
    )
    assert e.parts["reward model"] == 2 * (800 + 4 * 592 + 8 + 8)
    assert e.parts["critic states"] == 20 * 2000  # the critic keeps its own


def test_rlhf_estimate_follows_what_step3_holds(small):
    """The parts that step 3's options add or remove, as Step3Models describes them."""
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)
    zero0 = M.Choice(0, False, False)
    base = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2), zero0, hw)
    # critic-free estimators (rloo ...): no critic states, no critic training phase
    rloo = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, critic_trained=False), zero0, hw)
    assert "critic states" not in rloo.parts and base.device - rloo.device == 20 * 2000
    # --n_samples_per_prompt 3: three times the sequences in generation and experience
    many = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, samples_per_prompt=3), zero0, hw)
    [phase] = [v for k, v in many.parts.items() if k.startswith("activations")]
    assert phase >= M.forward_only_bytes(small, 12, 3, 2) > M.forward_only_bytes(small, 4, 3, 2)
    # the hybrid engine's inference copy: the actor once more in the training dtype, split by tensor parallelism
    copy = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, inference_copy=True, inference_tp_size=2),
                           zero0, hw)  # fmt: skip
    assert copy.parts["inference copy"] == 2 * 2792 // 2
    judged = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, judge=small), zero0, hw)
    assert judged.parts["judge"] == 2 * 2000

    # --share_frozen_trunk with a frozen bottom: the experience pass keeps (4 rows, 3 tokens, h 8) bf16
    # hidden states for the update, the reference and the reward model; the update holds one
    def rlhf(choice: M.Choice, **kw) -> M.Estimate:
        work = M.RLHFWorkload(
            small, small, 4, 4, 2, 1, 2, actor_trainable_layers=1, critic_trained=False, **kw
        )
        return M.estimate_rlhf(work, choice, hw)

    plain, kept = rlhf(zero0), rlhf(zero0, share_frozen_trunk=True)
    one = 4 * 3 * 8 * 2
    [(name, before)] = [(k, v) for k, v in plain.parts.items() if k.startswith("activations")]
    [after] = [v for k, v in kept.parts.items() if k.startswith("activations")]
    assert after == before + (3 * one if "experience" in name else one)
    # nothing kept under ZeRO-3 (the sharing needs whole blocks)
    z3 = M.Choice(3, False, False)
    assert rlhf(z3, share_frozen_trunk=True).device == rlhf(z3).device


def test_step3_models_read_the_options():
    from dschat.config import PPOArgs, RLHFEngineArgs, step3_models

    held = step3_models(RLHFEngineArgs(), PPOArgs())
    assert (held.critic, held.reference, held.reward_model, held.judge) == (True, True, True, False)
    held = step3_models(
        RLHFEngineArgs(share_reference_with_actor=True, judge_reward_model="runs/b", enable_hybrid_engine=True,
                       inference_tp_size=2),
        PPOArgs(advantage_estimator="rloo", n_samples_per_prompt=4, reward_fn="m:f", reward_fn_mode="replace",
                per_device_generation_batch_size=8),
    )  # fmt: skip
    assert (held.critic, held.reference, held.reward_model, held.judge) == (False, False, False, True)
    assert (held.inference_copy, held.inference_tp_size, held.rollouts_per_round) == (True, 2, 32)


def test_plan_picks_the_first_choice_that_fits(small):
    work = M.TrainWorkload(small, 2, 3, 2)
    sizes = {c: M.estimate_train(work, c, M.Hardware(1, on_gpu=True)).device for c in M.CANDIDATES}
    # a GPU just big enough for ZeRO-0 with checkpointing (not without): that is the pick
    need = sizes[M.Choice(0, False, True)]
    assert need < sizes[M.Choice(0, False, False)]
    hw = M.Hardware(1, on_gpu=True, device_bytes=int(need / M.FIT_FRACTION) + 1)
    est = [M.estimate_train(work, c, hw) for c in P.ordered_choices({}, on_gpu=True, devices=1)]
    chosen, reason = M.plan(est, hw)
    assert chosen.choice == M.Choice(0, False, True) and "fits" in reason
    # explicit flags restrict the choices: with ZeRO-3 fixed the pick has stage 3
    est3 = [M.estimate_train(work, c, hw) for c in P.ordered_choices({"zero_stage": 3}, on_gpu=True)]
    assert all(e.choice.zero_stage == 3 for e in est3)
    # nothing fits: the smallest, and the reason says so
    tiny = M.Hardware(1, on_gpu=True, device_bytes=1000)
    chosen, reason = M.plan([M.estimate_train(work, c, tiny) for c in M.CANDIDATES], tiny)
    assert chosen.device == min(M.estimate_train(work, c, tiny).device for c in M.CANDIDATES)
    assert reason.startswith("nothing fits")


def test_cpu_plans_share_the_node_ram_and_skip_offload():
    assert all(not c.offload for c in P.ordered_choices({}, on_gpu=False))
    assert any(c.offload for c in P.ordered_choices({"offload": True}, on_gpu=False))
    # one device: ZeRO 1-3 partition nothing, so only stage 0 and the offload choices are weighed
    assert {c.zero_stage for c in P.ordered_choices({}, on_gpu=True, devices=1) if not c.offload} == {0}
    hw = M.Hardware(gpus_per_node=4, on_gpu=False, cpu_node_bytes=8 * M.GIB)
    assert hw.per_process_budget == 2 * M.GIB


def test_choice_flags_leave_explicit_flags_alone():
    c = M.Choice(3, True, True)
    assert P.choice_flags(1, c, []) == ["--zero_stage", "3", "--offload", "--gradient_checkpointing"]
    assert P.choice_flags(1, c, ["--zero_stage", "3", "--offload"]) == ["--gradient_checkpointing"]
    assert P.choice_flags(3, c, ["--critic_zero_stage", "3"]) == [
        "--actor_zero_stage", "3", "--offload", "--offload_reference_model", "--offload_reward_model",
        "--actor_gradient_checkpointing", "--critic_gradient_checkpointing",
    ]  # fmt: skip
    assert P.fixed_choice(3, ["--actor_zero_stage=2", "--offload"]) == {
        "zero_stage_at_most": 2,
        "offload": True,
    }
    # actor and critic set apart: planned with what needs more memory (was the actor's ZeRO-3 for both,
    # an estimate of 70 GiB for a 6.7B pair that needs about 190 GiB with the critic at ZeRO-0)
    apart = ["--actor_zero_stage", "3", "--critic_zero_stage", "0", "--actor_gradient_checkpointing",
             "--no_critic_gradient_checkpointing"]  # fmt: skip
    assert P.fixed_choice(3, apart) == {"zero_stage": 0, "gradient_checkpointing": False}
    assert P.given(["--zero_stage", "1", "--zero_stage", "2"], "--zero_stage") == "2"  # argparse: last wins
    # a switch turned off (a preset's false, a user's --no_X) fixes the choice too, and the plan keeps it
    off = ["--no_gradient_checkpointing"]
    assert P.fixed_choice(1, off) == {"gradient_checkpointing": False}
    assert P.choice_flags(1, c, off) == ["--zero_stage", "3", "--offload"]
    assert P.fixed_choice(1, ["--no_offload", "--offload"]) == {"offload": True}  # the last one wins


def test_one_models_stage_in_step_3_leaves_the_others_to_the_plan():
    """``train.py --reward-zero-stage 3`` gives step 3 ``--critic_zero_stage 3`` alone: the plan took it as
    the stage of both and added ``--actor_zero_stage 3``, so one GPU generated under ZeRO-3 for nothing. The
    actor's stage is the plan's, at most the critic's (the estimate covers both at the lower stage, never
    below the need); a critic's checkpointing on leaves the actor's to the plan too."""
    fixed = P.fixed_choice(3, ["--critic_zero_stage", "3", "--critic_gradient_checkpointing"])
    assert "zero_stage" not in fixed and "gradient_checkpointing" not in fixed
    one_gpu = P.ordered_choices(fixed, on_gpu=True, devices=1)
    assert one_gpu[0] == M.Choice(0, False, False)  # the fastest, as without the critic's flags
    assert P.choice_flags(3, one_gpu[0], ["--critic_zero_stage", "3"]) == []
    # the actor never above the critic's stage; set apart the other way, the lower one is kept for both
    assert {
        c.zero_stage for c in P.ordered_choices(P.fixed_choice(3, ["--critic_zero_stage", "1"]), True)
    } == {0, 1}
    assert P.fixed_choice(3, ["--actor_zero_stage", "0"]) == {"zero_stage_at_most": 0}
    # a model's checkpointing off still fixes both (without it needs more memory)
    assert P.fixed_choice(3, ["--no_critic_gradient_checkpointing"]) == {"gradient_checkpointing": False}


def test_a_resumed_step_places_each_model_as_the_interrupted_run_did():
    """The plan may set actor and critic apart (the actor's stage given, the critic's picked); --resume
    took the actor's choice for both, and so put a ZeRO-0 critic's checkpoint into a ZeRO-3 engine. Each
    model's stage and checkpointing come from its own section; the flags given stay as given."""
    section = {"zero_stage": 0, "offload": False, "gradient_checkpointing": False}
    saved = {"actor": {**section, "zero_stage": 3, "gradient_checkpointing": True}, "critic": section,
             "offload_reference_model": False, "offload_reward_model": False}  # fmt: skip
    assert P.resumed_flags(3, saved, ["--actor_zero_stage", "3"]) == [
        "--critic_zero_stage", "0", "--actor_gradient_checkpointing"]  # fmt: skip
    offloaded = {**saved, "actor": {**saved["actor"], "offload": True}, "offload_reference_model": True}
    assert P.resumed_flags(3, offloaded, ["--no_actor_gradient_checkpointing"]) == [
        "--actor_zero_stage", "3", "--critic_zero_stage", "0", "--offload", "--offload_reference_model"]  # fmt: skip
    one = {"zero_stage": 2, "offload": True, "gradient_checkpointing": False}
    assert P.resumed_flags(1, one, []) == ["--zero_stage", "2", "--offload"]


def test_a_plan_for_step_3_without_a_critic_sets_no_critic_switch():
    """A critic-free step 3 refuses the critic's options; the plan's checkpointing added
    --critic_gradient_checkpointing beside the actor's, and the step refused its own plan at start-up. Its
    ZeRO stage stays (the reward model follows it)."""
    c = M.Choice(3, False, True)
    assert P.choice_flags(3, c, [], critic=False) == ["--actor_zero_stage", "3", "--critic_zero_stage", "3",
                                                     "--actor_gradient_checkpointing"]  # fmt: skip
    saved = {"actor": {"zero_stage": 3, "offload": False, "gradient_checkpointing": True},
             "critic": {"zero_stage": 3, "offload": False, "gradient_checkpointing": True},
             "offload_reference_model": False, "offload_reward_model": False}  # fmt: skip
    assert "--critic_gradient_checkpointing" not in P.resumed_flags(3, saved, [], critic=False)
    assert "--critic_gradient_checkpointing" in P.choice_flags(3, c, [])


OPT = {"model_type": "opt", "vocab_size": 100, "hidden_size": 16, "ffn_dim": 32, "num_hidden_layers": 2,
       "num_attention_heads": 2, "max_position_embeddings": 32}  # fmt: skip


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,
        {**SMALL, "model_type": "qwen2", "tie_word_embeddings": True},
        {**SMALL, "model_type": "mistral", "num_key_value_heads": 2},
        {**OPT, "word_embed_proj_dim": 8, "do_layer_norm_before": False},
        OPT,
        {"model_type": "gpt2", "vocab_size": 100, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 32},
    ],
    ids=["llama", "qwen2-tied", "mistral", "opt-350m-like", "opt", "gpt2"],
)
def test_counts_match_the_models_transformers_builds(cfg):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = transformers.CONFIG_MAPPING[cfg["model_type"]](
        **{k: v for k, v in cfg.items() if k != "model_type"}
    )
    config.num_labels = 1
    shape = S.shape_from_config(config.to_dict())
    for cls, head in ((AutoModelForCausalLM, "lm"), (AutoModelForSequenceClassification, "score")):
        with torch.device("meta"):
            model = cls.from_config(config)
        total = sum({id(p): p.numel() for p in model.parameters()}.values())
        assert shape.parameters(head) == total, head
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        assert shape.largest_layer_params(head) == largest


def test_known_configs_give_the_published_sizes():
    assert S.shape_from_config(S.KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"]).parameters() == 6_738_415_616
    assert S.shape_from_config(S.KNOWN_CONFIGS["facebook/opt-1.3b"]).parameters() == 1_315_758_080


def test_config_sources(tmp_path):
    import json

    cfg, where = S.load_model_config("facebook/OPT-1.3b")
    assert cfg["hidden_size"] == 2048 and "table" in where
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    cfg, where = S.load_model_config(str(tmp_path))
    assert cfg == SMALL and where.endswith("config.json")
    cfg, _ = S.load_model_config("builtin:micro-llama")
    assert cfg["hidden_size"] == 64
    with pytest.raises(
        UserError, match="--actor-model no-such-org/no-such-model: no config available offline"
    ):
        S.load_model_config("no-such-org/no-such-model", "--actor-model")
    with pytest.raises(UserError, match="unknown built-in model"):
        S.load_model_config("builtin:nope")
    weights = tmp_path / "model.bin"  # a binary file named where a model is: one line, not a traceback
    weights.write_bytes(bytes([0xC0, 0xFF, 0x00, 0x12]) * 8)
    with pytest.raises(
        UserError, match=r"--actor-model .*model.bin: not a model directory, config.json or GGUF"
    ):
        S.load_model_config(str(weights), "--actor-model")
    with pytest.raises(UserError, match="no 'hidden_size'"):
        S.shape_from_config({"model_type": "llama", "vocab_size": 3})


def test_rlhf_estimate_holds_the_actors_graph_through_the_experience_pass_where_a_round_is_one_update(small):
    """one_update_per_round: the update's activations are built in the experience pass and held through
    the other models' forwards, so that phase carries both (below ZeRO-3 only, as the step decides)."""
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)

    def activations(choice: M.Choice, **kw) -> tuple[str, int]:
        work = M.RLHFWorkload(small, small, 4, 4, 2, 1, 2, critic_trained=False, **kw)
        [(name, value)] = [(k, v) for k, v in M.estimate_rlhf(work, choice, hw).parts.items()
                           if k.startswith("activations")]  # fmt: skip
        return name, value

    zero0, z3 = M.Choice(0, False, False), M.Choice(3, False, False)
    training = M.activation_bytes(small, 4, 3, 2, False, "lm")
    assert activations(zero0, one_update_per_round=True) == (
        "activations: experience (forward passes)",
        M.forward_only_bytes(small, 4, 3, 2, entropy=True) + training,
    )
    assert activations(zero0)[1] == max(
        training, M.kv_cache_bytes(small, 4, 3, 2), M.forward_only_bytes(small, 4, 3, 2, entropy=True)
    )
    assert activations(z3, one_update_per_round=True) == activations(z3)
    # with the shared frozen trunk the actor's own hidden states are not kept: the pass is the update's
    one = 4 * 3 * 8 * 2
    fused = activations(zero0, one_update_per_round=True, share_frozen_trunk=True, actor_trainable_layers=1)[
        1
    ]
    frozen_training = M.activation_bytes(small, 4, 3, 2, False, "lm", 1)
    assert fused == M.forward_only_bytes(small, 4, 3, 2, entropy=True) + 2 * one + frozen_training


def test_rlhf_estimate_holds_the_critics_graph_through_the_experience_pass_where_its_round_is_one_update(
    small,
):
    """critic_one_update_per_round: the value update's activations are built in the experience pass too."""
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)

    def experience(choice: M.Choice, **kw) -> int:
        work = M.RLHFWorkload(small, small, 4, 4, 2, 1, 2, **kw)
        parts = M.estimate_rlhf(work, choice, hw).parts
        return max(v for k, v in parts.items() if k.startswith("activations"))

    zero0, z3 = M.Choice(0, False, False), M.Choice(3, False, False)
    forward = M.forward_only_bytes(small, 4, 3, 2, entropy=True)
    actor, critic = (
        M.activation_bytes(small, 4, 3, 2, False, "lm"),
        M.activation_bytes(small, 4, 3, 2, False, "score"),
    )
    both = dict(one_update_per_round=True, critic_one_update_per_round=True)
    assert experience(zero0, **both) == forward + actor + critic
    assert experience(zero0, one_update_per_round=True) == forward + actor
    assert experience(z3, **both) == experience(z3)


def test_make_plan_reads_one_update_per_round_from_step3s_options():
    from dschat.config import DataArgs, LoraArgs, ModelArgs, PPOArgs, RLHFEngineArgs

    hw = M.Hardware(gpus_per_node=1, on_gpu=False, cpu_node_bytes=8 * M.GIB)

    def workload(**ppo):
        m = ModelArgs(model_name_or_path="builtin:micro-llama", dropout=0.0)
        groups = (m, m, LoraArgs(), LoraArgs(), DataArgs(), RLHFEngineArgs(), PPOArgs(**ppo))
        return P.make_plan(3, groups, [], hw).workload

    assert workload(per_device_generation_batch_size=8, per_device_training_batch_size=8).one_update_per_round
    assert workload(
        per_device_generation_batch_size=8, per_device_training_batch_size=8
    ).critic_one_update_per_round
    assert not workload(
        per_device_generation_batch_size=8, per_device_training_batch_size=4
    ).one_update_per_round


def test_a_7b_model_on_8_gpus_of_40_gib_is_planned_with_zero2_not_zero1():
    """ZeRO-1 used to be estimated as ZeRO-2 (30.2 GiB) and, first in the order, picked; it keeps the whole
    bf16 gradient (about 12.6 GiB for 6.7B parameters) and does not fit 40 GiB. ZeRO-2 does."""
    shape = S.shape_from_config(S.load_model_config("meta-llama/Llama-2-7b-hf")[0])
    hw = M.Hardware(gpus_per_node=8, on_gpu=True, device_bytes=40 * M.GIB)
    work = M.TrainWorkload(shape, 1, 512, 2)
    est = [M.estimate_train(work, c, hw) for c in P.ordered_choices({}, on_gpu=True, devices=8)]
    by_choice = {e.choice: e for e in est}
    zero1, zero2 = by_choice[M.Choice(1, False, False)], by_choice[M.Choice(2, False, False)]
    p = shape.parameters()
    assert zero1.parts["model states"] - zero2.parts["model states"] == 2 * p - 2 * p // 8
    # and ZeRO-1's gradient bucket is fp32 (it stages the fp32 accumulator), ZeRO-2's bf16
    assert (zero1.parts["gradient bucket"], zero2.parts["gradient bucket"]) == (
        4 * 50_000_000,
        2 * 50_000_000,
    )
    chosen, _ = M.plan(est, hw)
    assert chosen.choice == M.Choice(2, False, False)


def test_when_nothing_fits_the_reason_names_the_memory_that_is_short():
    """A choice that fits the GPU but not the node's RAM: the message named the GPU (whose need was under its
    limit) and the pick was the smallest GPU need, i.e. the most offloaded, most RAM-hungry choice."""
    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=8 * M.GIB, cpu_node_bytes=20 * M.GIB)
    lean = M.Estimate(M.Choice(3, True, True), device=2 * M.GIB, cpu_node=40 * M.GIB)
    close = M.Estimate(M.Choice(3, False, True), device=6 * M.GIB, cpu_node=19 * M.GIB)
    chosen, reason = M.plan([lean, close], hw)
    assert chosen is close and reason.startswith(
        "nothing fits: the closest needs 19.00 GiB of CPU RAM per node"
    )
    gpu_short = M.Estimate(M.Choice(0, False, False), device=9 * M.GIB, cpu_node=1 * M.GIB)
    chosen, reason = M.plan([gpu_short], hw)
    assert reason.startswith("nothing fits 8.00 GiB per GPU") and "the closest needs 9.00 GiB" in reason


# ---------------------------------------------------------------- what step 3 holds that the plan missed
def test_explicit_no_offload_keeps_the_frozen_models_on_the_device(small):
    """--no_offload_reference_model / --no_offload_reward_model win over the plan's offload choice, as the
    flags the plan adds do (it never adds one the command line sets): the estimate kept them on the CPU."""
    from dschat.config import DataArgs, LoraArgs, ModelArgs, PPOArgs, RLHFEngineArgs

    hw = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)
    z3_offload = M.Choice(3, True, False)
    kept = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, offload_reference=False,
                                          offload_reward=False), z3_offload, hw)  # fmt: skip
    moved = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2), z3_offload, hw)
    assert kept.parts["reference"] == 2 * 800 + 2 * 2792 and moved.parts["reference"] == 2 * 800
    assert kept.parts["reward model"] == 2 * 800 + 2 * 2000 and moved.parts["reward model"] == 2 * 800

    m = ModelArgs(model_name_or_path="builtin:micro-llama", dropout=0.0)
    groups = (m, m, LoraArgs(), LoraArgs(), DataArgs(), RLHFEngineArgs(), PPOArgs())
    cpu = M.Hardware(gpus_per_node=1, on_gpu=False, cpu_node_bytes=8 * M.GIB)
    work = P.make_plan(3, groups, ["--no_offload_reference_model"], cpu).workload
    assert (work.offload_reference, work.offload_reward) == (False, None)


def test_the_actors_experience_pass_counts_the_entropys_temporaries(small):
    """The entropy of the rollouts' distribution takes 16 bytes per logit beyond the logits (log-softmax,
    its clamped copy, exp and product), not the 8 of a log-prob pass: (b, s, V) = (4, 3, 100) in bf16."""
    layer = M.layer_activation_bytes(small, 4, 3, 2)
    assert M.forward_only_bytes(small, 4, 3, 2) == layer + 4 * 3 * 100 * (2 + 8)
    assert M.forward_only_bytes(small, 4, 3, 2, entropy=True) == layer + 4 * 3 * 100 * (2 + 16)
    phases = M.rlhf_phases(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2), M.Choice(0, False, False))
    assert phases["experience (forward passes)"] == layer + 4 * 3 * 100 * 18


def test_the_ptx_terms_sft_batch_adds_to_the_actors_update(small):
    """--unsupervised_dataset_name: the SFT batch's graph (training batch x --max_seq_len) is built while
    the PPO loss's is alive."""
    zero0 = M.Choice(0, False, False)
    plain = M.rlhf_phases(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2), zero0)
    ptx = M.rlhf_phases(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, ptx_seq_len=7), zero0)
    assert ptx["actor training"] == plain["actor training"] + M.activation_bytes(small, 2, 7, 2, False, "lm")


def test_the_hybrid_engines_refill_under_zero3_gathers_the_actor(small):
    """Refilling the inference copy gathers the partitioned actor: whole (2792 parameters in bf16), or
    --tp_gather_partition_size layers at a time (one layer, 592, is below the embedding's 800)."""
    z3, zero0 = M.Choice(3, False, False), M.Choice(0, False, False)
    work = M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, inference_copy=True)
    assert M.rlhf_phases(work, z3)["hybrid switch (actor gathered)"] == 2 * 2792
    chunked = M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, inference_copy=True, gather_layers=1)
    assert M.rlhf_phases(chunked, z3)["hybrid switch (actor gathered)"] == 2 * 800
    assert "hybrid switch (actor gathered)" not in M.rlhf_phases(work, zero0)  # whole weights: no gather


def test_the_ema_is_counted_on_the_writing_ranks_memory(small):
    """--enable_ema: an fp32 average (4P) and the 16-bit gather of each update (2P) on the writing rank."""
    zero0 = M.Choice(0, False, False)
    gpu = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)
    base = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2), zero0, gpu)
    ema = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, ema=True), zero0, gpu)
    assert ema.cpu_node - base.cpu_node == 6 * 2792 and ema.device == base.device
    cpu = M.Hardware(gpus_per_node=2, on_gpu=False, cpu_node_bytes=8 * M.GIB)
    on_cpu = M.estimate_rlhf(M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, ema=True), zero0, cpu)
    assert on_cpu.parts["EMA (writing rank)"] == 6 * 2792


def test_deepspeeds_gradient_bucket_is_counted_per_trained_engine(small):
    """reduce_bucket_size (5e7 elements, set in every training config) per trained engine: none at ZeRO-0,
    fp32 at ZeRO-1, the training dtype at ZeRO-2/3."""
    from dschat.engine.ds_config import REDUCE_BUCKET_SIZE, train_ds_config

    cfg = train_ds_config(
        zero_stage=3, dtype="bf16", micro_batch_size=1, gradient_accumulation_steps=1, world_size=1
    )
    assert cfg["zero_optimization"]["reduce_bucket_size"] == REDUCE_BUCKET_SIZE == 50_000_000
    gpu = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)
    work = M.RLHFWorkload(small, small, 4, 2, 2, 1, 2)
    assert "gradient buckets" not in M.estimate_rlhf(work, M.Choice(0, False, False), gpu).parts
    assert (
        M.estimate_rlhf(work, M.Choice(1, False, False), gpu).parts["gradient buckets"] == 2 * 4 * 50_000_000
    )
    assert (
        M.estimate_rlhf(work, M.Choice(3, False, False), gpu).parts["gradient buckets"] == 2 * 2 * 50_000_000
    )
    rloo = M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, critic_trained=False)
    assert M.estimate_rlhf(rloo, M.Choice(2, False, False), gpu).parts["gradient buckets"] == 2 * 50_000_000


def test_gpus_planned_from_a_machine_without_any_do_not_judge_the_cpu_by_this_machines_ram(monkeypatch):
    """--device-memory 80 for an 8-node cluster, from a laptop: the plan said 'nothing fits: ... 44.81 GiB of
    CPU RAM per node, of 23.54 GiB', this machine's RAM. It is unknown unless --cpu-memory says it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hw = P.detect_hardware(8, 8, device_memory_gib=80)
    assert hw.on_gpu and hw.device_bytes == 80 * M.GIB and hw.cpu_node_bytes is None
    assert P.detect_hardware(8, 8, device_memory_gib=80, cpu_memory_gib=512).cpu_node_bytes == 512 * M.GIB
    assert P.detect_hardware(1, 1).cpu_node_bytes > 0  # this machine, planned as itself


def test_the_hybrid_engines_kept_generation_cache_stands_through_training_on_gpus(small):
    """On a GPU the hybrid engine keeps its StaticCache between rounds (unless --release_inference_cache):
    it is a standing part beside the training activations, not a passing phase weighed against them."""
    zero0 = M.Choice(0, False, False)
    gpu = M.Hardware(gpus_per_node=1, on_gpu=True, device_bytes=M.GIB)
    cpu = M.Hardware(gpus_per_node=1, on_gpu=False, cpu_node_bytes=8 * M.GIB)
    kept = M.RLHFWorkload(small, small, 4, 2, 2, 1, 2, inference_copy=True, kept_kv_cache=True)
    e = M.estimate_rlhf(kept, zero0, gpu)
    assert e.parts["KV cache (kept between rounds)"] == M.kv_cache_bytes(small, 4, 3, 2)
    assert not any("generation" in k for k in e.parts)
    assert "KV cache (kept between rounds)" not in M.estimate_rlhf(kept, zero0, cpu).parts  # a dynamic cache
