"""The checkpoint layer's tensor reader: any TP rank's slice read straight from per-rank files
saved at another TP size (only the rows or columns it needs), equal to slicing the full tensor."""

import pytest
import torch


def _saved(tmp_path, name, full, saved_tp, dim, stride):
    from safetensors.torch import save_file

    from setdiff_dist.checkpoint.sharding import split_shard
    from setdiff_dist.checkpoint.weights import TensorSource

    parts = []
    for r in range(saved_tp):
        file = str(tmp_path / f"{name}-tp{r}.safetensors")
        save_file({name: split_shard(full, r, saved_tp, dim, stride).contiguous()}, file)
        parts.append((file, {"tensor_parallel": saved_tp > 1, "dim": dim, "stride": stride}))
    return TensorSource({name: parts}, rows=full.shape[0])


@pytest.mark.parametrize("saved_tp,target_tp", [(1, 2), (4, 2), (2, 4), (2, 2), (4, 1)])
@pytest.mark.parametrize("dim,stride", [(0, 1), (1, 1), (0, 2)],
                         ids=["column", "row", "swiglu-halves"])
def test_a_shard_read_from_files_of_another_tp_size_equals_slicing_the_full_tensor(
        tmp_path, saved_tp, target_tp, dim, stride):
    from setdiff_dist.checkpoint.sharding import split_shard

    full = torch.randn(32, 24) if dim == 0 else torch.randn(24, 32)
    source = _saved(tmp_path, "w", full, saved_tp, dim, stride)
    assert source.shape("w") == list(full.shape)
    assert torch.equal(source["w"], full)
    for rank in range(target_tp):
        want = split_shard(full, rank, target_tp, dim, stride)
        assert torch.equal(source.shard("w", rank, target_tp, dim, stride), want), rank
