"""CIFAR-10 read from the python-version files (a directory or the archive), no download."""

import pickle
import tarfile

import pytest
import torch

from lightning_parallel.demo import CIFAR10DataModule, build_datamodule, default_data

FILES = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]


def _write_batches(directory, per_file=4):
    """CIFAR's layout: pickled dicts of uint8 (N, 3072) images and a list of labels."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for index, name in enumerate(FILES):
        data = torch.randint(0, 256, (per_file, 3072), generator=generator, dtype=torch.uint8)
        labels = [(index + k) % 10 for k in range(per_file)]
        with (directory / name).open("wb") as stream:
            pickle.dump({b"data": data.numpy(), b"labels": labels}, stream)
    return directory


def test_reads_the_extracted_directory_or_its_parent(tmp_path):
    folder = _write_batches(tmp_path / "cifar-10-batches-py")
    for path in (folder, tmp_path):
        data = build_datamodule("cifar10", path=str(path), batch_size=4)
        data.setup()
        images, labels = data.train_set.tensors
        assert images.shape == (20, 3, 32, 32) and labels.tolist()[:4] == [0, 1, 2, 3]
        assert data.val_set.tensors[0].shape == (4, 3, 32, 32)
        # normalized per channel with the training set's statistics
        assert torch.allclose(images.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5)
        assert torch.allclose(images.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-4)
        assert data.input_shape == (3, 32, 32) and data.num_classes == 10


def test_reads_the_archive_and_keeps_the_first_samples(tmp_path):
    folder = _write_batches(tmp_path / "cifar-10-batches-py")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    from_dir = CIFAR10DataModule(str(folder), num_samples=6, batch_size=2)
    from_tar = CIFAR10DataModule(str(archive), num_samples=6, batch_size=2)
    from_dir.setup(), from_tar.setup()
    assert len(from_tar.train_set) == 6
    for a, b in zip(from_dir.train_set.tensors, from_tar.train_set.tensors):
        assert torch.equal(a, b)


def test_augmentation_crops_and_flips_training_images_only(tmp_path):
    folder = _write_batches(tmp_path / "c")
    data = CIFAR10DataModule(str(folder), augment=True, batch_size=4, seed=1)
    data.setup()
    image, label = data.train_set[0]
    assert image.shape == (3, 32, 32) and int(label) == 0
    x, _ = next(iter(data.train_dataloader()))
    assert x.shape == (4, 3, 32, 32)
    assert len(data.val_set) == 4 and data.val_set[0][0].shape == (3, 32, 32)


def test_missing_files_say_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="downloads nothing"):
        CIFAR10DataModule(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    data = CIFAR10DataModule(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="lacks the CIFAR-10 files"):
        data.setup()


def test_each_bundled_model_has_data_of_its_kind():
    assert default_data("resnet50") == "synthetic" and default_data("vgg16") == "synthetic"
    assert default_data("gpt") == "corpus" and default_data("recommender") == "interactions"
    assert default_data("vgg_mini") == "digits"
