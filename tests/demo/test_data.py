import pytest
import torch

from lightning_parallel.demo import DigitsDataModule, SyntheticImageDataModule, build_datamodule


def test_digits_split_is_fixed_by_seed_and_normalized():
    first, second = DigitsDataModule(seed=3), DigitsDataModule(seed=3)
    first.setup(), second.setup()
    assert len(first.train_set) + len(first.val_set) == 1797
    assert torch.equal(first.val_set.tensors[0], second.val_set.tensors[0])
    train_x = first.train_set.tensors[0]
    assert train_x.shape[1:] == (1, 32, 32) == first.input_shape
    assert abs(train_x.mean().item()) < 1e-4 and abs(train_x.std().item() - 1) < 1e-3
    other = DigitsDataModule(seed=4)
    other.setup()
    assert not torch.equal(other.val_set.tensors[1], first.val_set.tensors[1])


def test_digits_without_resize_keeps_8x8():
    data = DigitsDataModule(resize=False)
    data.setup()
    assert data.train_set.tensors[0].shape[1:] == (1, 8, 8) == data.input_shape


def test_training_batches_are_whole():
    data = DigitsDataModule(batch_size=100)
    data.setup()
    assert {len(x) for x, _ in data.train_dataloader()} == {100}


def test_synthetic_is_deterministic_and_sized():
    a = SyntheticImageDataModule(num_samples=256, image_size=16, channels=3, seed=1)
    b = build_datamodule("synthetic", num_samples=256, image_size=16, channels=3, seed=1)
    a.setup(), b.setup()
    assert a.train_set.tensors[0].shape == (256, 3, 16, 16)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert torch.equal(a.val_set.tensors[1], b.val_set.tensors[1])


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        (DigitsDataModule, {"batch_size": 0}, "batch_size"),
        (DigitsDataModule, {"val_fraction": 1.5}, "val_fraction"),
        (SyntheticImageDataModule, {"num_classes": 1}, "num_classes"),
        (SyntheticImageDataModule, {"num_samples": 0}, "num_samples"),
    ],
)
def test_bad_arguments_raise_at_construction(factory, kwargs, message):
    with pytest.raises(ValueError, match=message):
        factory(**kwargs)


def test_unknown_data_name_lists_the_choices():
    with pytest.raises(ValueError, match="digits"):
        build_datamodule("cifar")
