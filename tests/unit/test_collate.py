"""dschat.data.collate: SFT label masking and batch padding, on exact values."""

from __future__ import annotations

import torch

from dschat.data.collate import IGNORE_INDEX, SFTCollator, sft_example

M = IGNORE_INDEX


def test_ignore_index_is_torch_default():
    assert IGNORE_INDEX == -100


def test_sft_example_masks_the_prompt_and_keeps_eos():
    assert sft_example([1, 10, 11], [20, 21], 2, False) == {
        "input_ids": [1, 10, 11, 20, 21, 2],
        "labels": [M, M, M, 20, 21, 2],
    }


def test_sft_example_train_on_prompt():
    assert sft_example([1, 10, 11], [20, 21], 2, True) == {
        "input_ids": [1, 10, 11, 20, 21, 2],
        "labels": [1, 10, 11, 20, 21, 2],
    }


def test_sft_example_without_eos():
    assert sft_example([5], [6, 7], None, False) == {"input_ids": [5, 6, 7], "labels": [M, 6, 7]}


def test_sft_example_empty_prompt():
    assert sft_example([], [6], 2, False) == {"input_ids": [6, 2], "labels": [6, 2]}


def test_sft_example_does_not_alias_inputs():
    prompt, response = [1, 2], [3]
    ex = sft_example(prompt, response, 9, True)
    ex["input_ids"].append(0)
    ex["labels"].append(0)
    assert prompt == [1, 2] and response == [3]
    assert ex["input_ids"] is not ex["labels"]


def test_collator_pads_right_to_the_longest():
    a = sft_example([1, 10, 11], [20, 21], 2, False)  # length 6
    b = sft_example([1, 12], [22], 2, False)  # length 4
    batch = SFTCollator(pad_id=0)([a, b])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 10, 11, 20, 21, 2], [1, 12, 22, 2, 0, 0]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]))
    assert torch.equal(batch["labels"], torch.tensor([[M, M, M, 20, 21, 2], [M, M, 22, 2, M, M]]))
    for t in batch.values():
        assert t.dtype == torch.long


def test_collator_pad_id_is_used():
    batch = SFTCollator(pad_id=7)(
        [{"input_ids": [1], "labels": [1]}, {"input_ids": [1, 2, 3], "labels": [M, 2, 3]}]
    )
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 7, 7], [1, 2, 3]]))
    assert torch.equal(batch["labels"], torch.tensor([[1, M, M], [M, 2, 3]]))


def test_collator_pad_to_multiple_of():
    feats = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [M, M, 3, 4, 5]},
        {"input_ids": [1, 2], "labels": [M, 2]},
    ]
    batch = SFTCollator(pad_id=0, pad_to_multiple_of=4)(feats)
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0]]))
    assert torch.equal(
        batch["attention_mask"], torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    )
    assert torch.equal(batch["labels"], torch.tensor([[M, M, 3, 4, 5, M, M, M], [M, 2, M, M, M, M, M, M]]))


def test_collator_exact_multiple_adds_nothing():
    feats = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}]
    assert SFTCollator(pad_id=0, pad_to_multiple_of=4)(feats)["input_ids"].shape == (1, 4)
    assert SFTCollator(pad_id=0, pad_to_multiple_of=8)(feats)["input_ids"].shape == (1, 8)


def test_collator_single_equal_lengths_no_padding():
    feats = [{"input_ids": [4, 5], "labels": [M, 5]}, {"input_ids": [6, 7], "labels": [6, 7]}]
    batch = SFTCollator(pad_id=0)(feats)
    assert torch.equal(batch["attention_mask"], torch.ones(2, 2, dtype=torch.long))
    assert torch.equal(batch["labels"], torch.tensor([[M, 5], [6, 7]]))


def test_length_batches_group_similar_lengths_longest_first_and_cover_every_index_once():
    from dschat.data.collate import length_batches

    lengths = [3, 40, 5, 38, 4, 39, 1]
    batches = length_batches(lengths, 2)
    assert batches == [[1, 5], [3, 2], [4, 0], [6]]  # 40 39 | 38 5 | 4 3 | 1
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert length_batches([], 4) == []
