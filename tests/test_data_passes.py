"""Every pass over the data sees the same samples in the same order: loaders and iterables whose passes differ
(shuffling, dropping, one-shot, shrinking, augmenting) are refused with the likely cause named."""

import pytest
import torch
from cases import make_case
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, TensorDataset

import landscape
from sharpness import HVP_STRATEGIES, DataError, Objective
from sharpness.products import ChunkedData
from sharpness.products._data import digest


def batches(X, y, size=5):
    return [(X[i : i + size], y[i : i + size]) for i in range(0, X.shape[0], size)]


class OneShot(IterableDataset):
    """An IterableDataset over a generator made once: its second pass yields nothing."""

    def __init__(self, X, y):
        self.batches = iter(batches(X, y))

    def __iter__(self):
        return self.batches


class Shrinking:
    """All batches on the first pass, the first ``later`` batches on every other one."""

    def __init__(self, X, y, later):
        self.all, self.later, self.passes = batches(X, y), later, 0

    def __iter__(self):
        self.passes += 1
        return iter(self.all if self.passes == 1 else self.all[: self.later])


class Changing:
    """The same batches until ``changed`` is set, then samples 0 and 1 swapped (inputs and targets alike)."""

    def __init__(self, X, y):
        self.X, self.y, self.changed = X, y, False

    def __iter__(self):
        order = torch.arange(self.X.shape[0])
        if self.changed:
            order[[0, 1]] = order[[1, 0]]
        return iter(batches(self.X[order], self.y[order]))


class Noisy(Dataset):
    """A map-style dataset with a random augmentation (noise drawn on every read)."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __len__(self):
        return self.X.shape[0]

    def __getitem__(self, i):
        return self.X[i] + 0.01 * torch.randn(self.X.shape[1:], dtype=self.X.dtype), self.y[i]


class Reshuffling(torch.utils.data.Sampler):
    """A sampler of its own that draws a new order on every pass (not one of torch's random samplers)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


@pytest.fixture
def case():
    return make_case("mlp_bias")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"shuffle": True}, "the DataLoader shuffles (shuffle=True or a random sampler), so every pass over the data, "
                            "and so every Hessian-vector product, would see them in another order; pass shuffle=False"),
        ({"shuffle": True, "drop_last": True}, "and drops its last incomplete batch (drop_last=True), so every pass "
                                               "over the data, and so every Hessian-vector product, would see another "
                                               "subset of the samples; pass shuffle=False"),
        ({"sampler": "random"}, "the DataLoader shuffles"),
        ({"batch_sampler": "random"}, "the DataLoader shuffles"),
    ],
)  # fmt: skip
def test_a_shuffling_loader_is_refused_before_any_pass(case, options, message):
    reads = []

    class Counted(TensorDataset):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    dataset = Counted(case.X, case.y)
    if options.get("sampler") == "random":
        options = {"sampler": RandomSampler(dataset)}
    if options.get("batch_sampler") == "random":
        options = {"batch_sampler": BatchSampler(RandomSampler(dataset), 5, drop_last=False)}
    loader = DataLoader(dataset, **{"batch_size": 5, **options} if "batch_sampler" not in options else options)
    with pytest.raises(DataError) as caught:
        Objective(case.model, case.loss_fn, loader)
    assert message in str(caught.value) and not reads


def test_a_one_shot_iterable_is_named_not_blamed_on_ignore_index(case):
    for data in (OneShot(case.X, case.y), DataLoader(OneShot(case.X, case.y), batch_size=None)):
        with pytest.raises(DataError, match="the data yielded no samples on this pass after 23 on the first: it is a "
                                            "one-shot iterable"):  # fmt: skip
            Objective(case.model, case.loss_fn, data)


def test_an_iterable_yielding_fewer_or_more_batches_later_is_refused(case):
    with pytest.raises(DataError, match="the data yielded 15 samples on this pass and 23 on the first: an iterable "
                                        "that yields fewer or more batches"):  # fmt: skip
        Objective(case.model, case.loss_fn, Shrinking(case.X, case.y, later=3)).value()
    growing = Changing(case.X, case.y)
    obj = Objective(case.model, case.loss_fn, growing)
    growing.X, growing.y = torch.cat([case.X, case.X[:2]]), torch.cat([case.y, case.y[:2]])
    with pytest.raises(DataError, match="the data yielded more than the 23 samples of its first pass"):
        obj.value(obj.layout.flatten(obj.params))


def test_a_sampler_that_reorders_and_a_random_augmentation_are_refused(case):
    reordering = DataLoader(TensorDataset(case.X, case.y), batch_size=5, sampler=Reshuffling(23))
    torch.manual_seed(0)
    for data in (reordering, DataLoader(Noisy(case.X, case.y), batch_size=5)):
        with pytest.raises(DataError, match=r"the same number of samples \(23\) on this pass as on the first but "
                                            "other values or another order: a shuffling loader"):  # fmt: skip
            Objective(case.model, case.loss_fn, data).value()


def _operations(obj: Objective) -> dict:
    v = torch.randn(obj.layout.size, dtype=obj.dtype, generator=torch.Generator().manual_seed(0))
    point = obj.layout.flatten(obj.params)
    ops = {
        "value": lambda: obj.value(point),
        "gradient": obj.gradient,
        "evaluate": obj.evaluate,
        "pieces": lambda: list(obj.pieces(4, join=True)),
        "plane": lambda: landscape.loss_plane(None, None, None, grid=landscape.Grid(span=0.1, steps=2),
                                              objective=obj, progress=False),  # fmt: skip
        "hvp_batch": lambda: obj.hvp_batch(torch.stack([v, v])),
    }
    for strategy in HVP_STRATEGIES:
        if strategy != "rop" or obj._rop is not None:
            ops[f"hvp_{strategy}"] = lambda s=strategy: obj.hvp(v, s)
    return ops


def test_every_evaluation_refuses_a_pass_that_differs(case):
    names = _operations(Objective(case.model, case.loss_fn, case.data)).keys()
    for name in names:
        source = Changing(case.X, case.y)
        obj = Objective(case.model, case.loss_fn, source, chunk_size=7)
        source.changed = True
        with pytest.raises(DataError, match="other values or another order"):
            _operations(obj)[name]()


def test_a_pass_left_midway_is_not_a_changed_pass(case):
    source = Shrinking(case.X, case.y, later=5)  # the same batches on every pass
    obj = Objective(case.model, case.loss_fn, source, chunk_size=4)
    reference = Objective(case.model, case.loss_fn, batches(case.X, case.y), chunk_size=4)  # the same chunks
    for _ in range(3):
        obj.data.first_batch()
        next(iter(obj.data))
        next(iter(obj.chunks()))
    assert obj.value() == reference.value()
    torch.testing.assert_close(obj.gradient(), reference.gradient(), rtol=0, atol=0)


def test_first_batch_reads_no_pass_that_could_go_unchecked(case):
    """The first batch comes from the first complete pass, so a one-shot iterable is not left one batch short."""
    data = ChunkedData(OneShot(case.X, case.y), chunk_size=3)
    x, y = data.first_batch()
    assert torch.equal(x, case.X[:3]) and torch.equal(y, case.y[:3]) and data.n_samples == 23
    with pytest.raises(DataError, match="one-shot iterable"):
        list(data)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                                   torch.int64])  # fmt: skip
def test_the_digest_sees_order_content_and_place_but_not_batching(dtype):
    g = torch.Generator().manual_seed(0)
    X = (100 * torch.rand(30, 3, 4, generator=g)).to(dtype)
    whole = digest(X)
    assert whole.dtype == torch.int64 and whole.shape == ()
    assert int(digest(X[:7]) + digest(X[7:19], 7) + digest(X[19:], 19)) == int(whole)  # batching does not count
    swapped = X.clone()
    swapped[[3, 11]] = X[[11, 3]]
    assert int(digest(swapped)) != int(whole)  # two samples swapped
    assert int(digest(X.flip(-1))) != int(whole)  # values moved within each sample
    assert int(digest(X[:29])) != int(whole) and int(digest(X, 1)) != int(whole)
    changed = X.clone()
    changed[17, 2, 1] += 1
    assert int(digest(changed)) != int(whole)
    labels = torch.tensor([0, 1, 2, 0, 1])
    assert int(digest(labels)) != int(digest(labels[[1, 0, 2, 3, 4]]))
    assert int(digest(torch.empty(0, 3, dtype=dtype))) == 0


def test_fingerprint_is_exact_and_order_sensitive(case):
    one = ChunkedData(case.data).fingerprint()
    assert one == ChunkedData(batches(case.X, case.y, size=4)).fingerprint()  # the same however batched
    order = torch.randperm(23, generator=torch.Generator().manual_seed(1))
    permuted = ChunkedData((case.X[order], case.y[order])).fingerprint()
    assert permuted[0] == one[0] and permuted[1] != one[1] and permuted[2] != one[2]


def test_a_data_file_holding_a_tuple_is_one_sentence_naming_the_format(tmp_path, capsys, monkeypatch):
    from sharpness._cli import main

    monkeypatch.chdir(tmp_path)
    from sharpness.cli import build_model

    torch.save(build_model("mlp:4-3").state_dict(), "m.pt")
    torch.save((torch.randn(6, 4), torch.arange(6) % 3), "pair.pt")
    code = main(["compute", "--model", "mlp:4-3", "--checkpoint", "m.pt", "--data", "pair.pt", "--quiet"])
    assert code == 2
    assert capsys.readouterr().err == (
        "error: data file pair.pt holds a tuple, not a dictionary with tensors X and y; save a dictionary instead: "
        "torch.save({'X': X, 'y': y}, 'data.pt'), or np.savez('data.npz', X=X, y=y)\n"
    )
