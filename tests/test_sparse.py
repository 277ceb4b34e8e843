import pytest
import torch

from pipeline.sparse import KeyedJaggedTensor


def test_from_lists_and_offsets():
    bags = [[[3], [5]], [[1, 2], []]]
    kjt = KeyedJaggedTensor.from_lists(["C1", "C2"], bags)
    assert kjt.batch_size == 2
    assert kjt.offsets().tolist() == [0, 1, 2, 4, 4]
    assert kjt["C2"].offsets.tolist() == [0, 2, 2]
    assert kjt["C2"].values.tolist() == [1, 2]
    assert kjt.values.tolist() == [3, 5, 1, 2]
    assert kjt.lengths.tolist() == [1, 1, 2, 0]


def test_from_dense_is_key_major():
    ids = torch.tensor([[1, 10], [2, 20], [3, 30]])
    kjt = KeyedJaggedTensor.from_dense(["a", "b"], ids)
    assert kjt.values.tolist() == [1, 2, 3, 10, 20, 30]
    assert kjt["b"].values.tolist() == [10, 20, 30]
    with pytest.raises(ValueError, match=r"\[batch, 3\]"):
        KeyedJaggedTensor.from_dense(["a", "b", "c"], ids)


def test_lengths_must_match_keys():
    with pytest.raises(ValueError, match="multiple of 2 keys"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1]), torch.tensor([1, 0, 0]))


def test_length_per_key_is_known_from_dense_ids_moves_with_the_batch_and_is_checked():
    kjt = KeyedJaggedTensor.from_dense(["a", "b"], torch.tensor([[1, 10], [2, 20], [3, 30]]))
    assert kjt.length_per_key == [3, 3] and kjt.to("cpu").length_per_key == [3, 3]
    assert KeyedJaggedTensor.from_lists(["a"], [[[1, 2]]]).length_per_key is None
    with pytest.raises(ValueError, match="length_per_key"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 2]), [1, 1])
