"""Many devices: the process group torchrun starts, DDP and FSDP2, and the few collectives the
trainer needs to give the same result at any world size.

    torchrun --nproc-per-node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] -m grpo_fast train ...

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK in the environment) :func:`setup` joins the
job's process group: NCCL on CUDA (one device per process, ``cuda:LOCAL_RANK``), gloo on
CPU, every collective bounded by a timeout, so a rank that dies or hangs stops the job
instead of leaving the others waiting. Without torchrun there is no process group and every
collective of :class:`Ranks` is the identity: a single process runs exactly the code it
always ran.

What each rank holds (``parallel``):

    ddp    a replica of the weights, gradients and AdamW states (DistributedDataParallel);
           gradients are averaged over ranks once per optimizer step
    fsdp   a 1/N shard of each (FSDP2 ``fully_shard``, one unit per decoder layer, the rest in
           the root unit); a layer's weights are gathered for its forward and backward only

Both average gradients over ranks, so a rank weighs its micro-batches by ``world_size``
times their share of the global batch (``GRPOTrainer.accumulate_gradients``).

Sequence parallelism (``sequence_parallel`` N, ``grpo_fast/packing/sequence_parallel.py``):
consecutive ranks ``[k * N, (k + 1) * N)`` are a sequence group, which shares one share of the
batch and runs each packed row's tokens split over its ranks; the ranks with one place in their
group are a data-parallel group of ``world_size / N``. The batch's share, its sums and gathers
(:meth:`Ranks.share`, :meth:`Ranks.sum`, :meth:`Ranks.gather_rows`) go over the data-parallel
group, so a group's ranks, holding the same rows, count them once. DDP and FSDP2 still average
over every rank: a rank's gradient is its tokens' share of its group's, the group's sum is the
whole rows', and the one average over ``world_size`` ranks, with each rank's loss weighed by
``world_size``, is the batch's gradient, as without it. Collectives
must be called by every rank in the same order: under FSDP2 every forward all-gathers, so
ranks run the same number of micro-batches (:meth:`Ranks.lockstep` pads the shorter lists
with a one-token filler whose loss is multiplied by 0), and generation, whose number of
forwards depends on what was sampled, runs with the weights gathered once (:func:`gathered`).
"""

import contextlib
import datetime
import os
import types
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist


def launched_by_torchrun() -> bool:
    """Whether torchrun (or another launcher with its environment) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_device(device: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU; under torchrun a CUDA device without an
    index is this process's own, ``cuda:LOCAL_RANK``, and another index is a ValueError
    (every rank would share that GPU)."""
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    resolved = torch.device(kind)
    if resolved.type != "cuda":
        return resolved
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if launched_by_torchrun() else 0
    if resolved.index is None:
        return torch.device("cuda", local_rank)
    if launched_by_torchrun() and resolved.index != local_rank:
        raise ValueError(
            f"device={device!r} under torchrun: each process trains on its own GPU, cuda:LOCAL_RANK (here "
            f"cuda:{local_rank}); pass device='cuda' or 'auto'"
        )
    return resolved


def setup(device: torch.device, timeout_s: float, sequence_parallel: int = 1) -> "Ranks":
    """Joins torchrun's job (NCCL on CUDA, gloo on CPU; collectives time out after
    ``timeout_s``) unless a process group already exists, which is then used as it is.
    Returns this process's :class:`Ranks` (its groups of ``sequence_parallel`` ranks made);
    a single process without torchrun gets rank 0 of 1.
    In a job, a CUDA ``device`` becomes the process's current device (NCCL's object
    collectives and FSDP2 use it)."""
    joining = launched_by_torchrun() and not dist.is_initialized()
    if device.type == "cuda" and (joining or dist.is_initialized()):
        torch.cuda.set_device(device)
    if joining:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return Ranks(device, sequence_parallel, timeout_s)


# Bound methods (weakly held) that shutdown() calls first: an in-process engine that made
# process groups of its own (vLLM) closes them while the default group still exists.
_BEFORE_SHUTDOWN: list = []


def before_shutdown(method) -> None:
    """Calls the bound ``method`` at :func:`shutdown`, before the process group goes, if its
    object still lives then."""
    _BEFORE_SHUTDOWN.append(weakref.WeakMethod(method))


def _release_reducer(replica) -> None:
    """Frees a DDP module's reducer (and the logger that holds it) while the process group
    still exists. The reducer owns the group from C++: freed after the group has left torch's
    registry, it would be the group's last owner, and gloo's destructor would join its worker
    threads with the GIL held, while a worker freeing a finished collective's tensors waits
    for the GIL (a deadlock at the end of a run: about one 2-rank run in twenty on a loaded
    2-core host). Freed first, the registry's handle is the last owner, and it lets the GIL go
    while it joins."""
    replica.logger = replica.reducer = None


def shutdown() -> None:
    """Leaves the process group, if there is one (the end of a successful run)."""
    while _BEFORE_SHUTDOWN:
        method = _BEFORE_SHUTDOWN.pop()()
        if method is not None:
            method()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def sequence_layout(world_size: int, sequence_parallel: int) -> tuple:
    """``(sequence groups, data-parallel groups)`` of a job, lists of ranks: N =
    ``sequence_parallel`` consecutive ranks a sequence group (the ranks most likely on one node,
    where the all-to-alls run), and the ranks of one place in their groups a data-parallel
    group, in rank order (a rank's index in it is ``rank // N``, its ``data_rank``)."""
    sequence = [list(range(first, first + sequence_parallel)) for first in range(0, world_size, sequence_parallel)]
    data = [list(range(place, world_size, sequence_parallel)) for place in range(sequence_parallel)]
    return sequence, data


class Ranks:
    """This process's place in the job and the collectives the trainer uses. Tensors travel
    on ``device`` (NCCL reduces CUDA tensors only) and come back where they were.

    ``rank`` and ``world_size`` count processes. With ``sequence_parallel`` N > 1 (see the
    module docstring) ``sequence_group`` is this rank's group of N (None at N = 1), and the
    batch's collectives go over its data-parallel group: ``data_rank`` of ``data_size``
    (``rank // N`` of ``world_size / N``); their collectives time out after ``timeout_s``, as
    the job's (None: torch's default)."""

    def __init__(self, device: torch.device, sequence_parallel: int = 1, timeout_s: float | None = None):
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        self.device = device
        if self.world_size % sequence_parallel:
            raise ValueError(
                f"sequence_parallel={sequence_parallel} must divide the world size {self.world_size}: each "
                "sequence group is that many ranks"
            )
        self.sequence_parallel = sequence_parallel
        self.data_rank, self.data_size = self.rank // sequence_parallel, self.world_size // sequence_parallel
        self.sequence_group = self._data_group = None
        if sequence_parallel > 1:  # every rank makes every group, in one order
            timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
            sequence, data = sequence_layout(self.world_size, sequence_parallel)
            self.sequence_group, _ = dist.new_subgroups_by_enumeration(sequence, timeout=timeout)
            self._data_group, _ = dist.new_subgroups_by_enumeration(data, timeout=timeout)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes the run's logs, plot and final model."""
        return self.rank == 0

    def sum(self, value):
        """The sum over the data-parallel ranks of a number or a tensor (same shape on every rank)."""
        return self._all_reduce(value, dist.ReduceOp.SUM, self._data_group)

    def max(self, value):
        """The largest over ranks of a number or a tensor (elementwise)."""
        return self._all_reduce(value, dist.ReduceOp.MAX)

    def _all_reduce(self, value, op, group=None):
        """``value`` (a number or a tensor) reduced over ``group``'s ranks (None: all) by ``op``,
        returned as it came."""
        if self.world_size == 1:
            return value
        if torch.is_tensor(value):
            total = value.to(self.device, copy=True)
        else:  # float64 for floats: Python's own addition, whatever the order
            total = torch.tensor(
                value, dtype=torch.float64 if isinstance(value, float) else torch.long, device=self.device
            )
        dist.all_reduce(total, op=op, group=group)
        if torch.is_tensor(value):
            return total.to(value.device)
        return type(value)(total.item())

    def share(self, count: int) -> slice:
        """This rank's contiguous share of ``count`` items that every rank holds alike (``count``
        divisible by ``data_size``; a sequence group's ranks share one)."""
        size = count // self.data_size
        return slice(self.data_rank * size, (self.data_rank + 1) * size)

    def gather_rows(self, x: torch.Tensor) -> tuple:
        """``(every data-parallel rank's rows of x, in rank order, on x's device; the index of
        this rank's first row)``. Ranks may hold different numbers of rows; the other dimensions
        must agree."""
        if self.data_size == 1:
            return x, 0
        group = self._data_group
        counts = [torch.zeros((), dtype=torch.long, device=self.device) for _ in range(self.data_size)]
        dist.all_gather(counts, torch.tensor(len(x), device=self.device), group=group)
        counts = [int(c) for c in counts]
        wire = x.to(self.device, torch.uint8 if x.dtype == torch.bool else x.dtype)
        padded = wire.new_zeros((max(counts), *x.shape[1:]))
        padded[: len(x)] = wire
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        rows = torch.cat([part[:n] for part, n in zip(parts, counts)]).to(x.device, x.dtype)
        return rows, sum(counts[: self.data_rank])

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (a picklable object)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def same_in_sequence_group(self, x: torch.Tensor, what: str) -> None:
        """ValueError unless every rank of this rank's sequence group holds the same ``x`` (a
        checksum compared: its size, sum and position-weighted sum), which sequence parallelism
        needs of the rollouts; nothing without sequence groups."""
        if self.sequence_group is None:
            return
        values = x.detach().to(self.device, torch.float64).flatten()
        weights = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=self.device)
        low = torch.stack([values.new_tensor(float(values.numel())), values.sum(), (values * weights).sum()])
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.sequence_group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.sequence_group)
        if not torch.equal(low, high):
            raise ValueError(
                f"sequence_parallel={self.sequence_parallel}: the ranks of a sequence group hold different {what}; "
                "they must sample the same rollouts (generator='sampler' keys each sample by its prompt, not its rank)"
            )

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def lockstep(self, items: list) -> Iterator[tuple]:
        """``(item or None, sync)`` pairs: the items, then None until each rank has yielded as
        many pairs as the rank with the most items; ``sync`` is True on the last pair only (the
        backward that reduces gradients). A single process yields its items alone."""
        count = self.max(len(items))
        for i in range(count):
            yield (items[i] if i < len(items) else None), i == count - 1


# ---------------------------------------------------------------- DDP and FSDP2
def wrap(module: torch.nn.Module, parallel: str, runtime, *, trainable: bool = True):
    """``module`` ready for this job: as it is in a single process; else DDP (when
    ``trainable``; a frozen module needs no gradient reduction and stays a plain replica) or
    FSDP2, sharded in place, one unit per decoder layer (the model's ``_no_split_modules``)
    and the rest in the root unit, its weights gathered in the runtime's 16-bit dtype (if
    any) and its gradients reduced in float32."""
    device = runtime.device
    if not dist.is_initialized():
        return module
    if parallel == "ddp":
        if not trainable:
            return module
        from torch.nn.parallel import DistributedDataParallel

        replica = DistributedDataParallel(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,  # rotary tables and the like are constants: no broadcast per forward
            gradient_as_bucket_view=True,  # the reduction buckets are the gradients, not a second copy
        )
        before_shutdown(types.MethodType(_release_reducer, replica))
        return replica
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The mesh of the trainer's device type: without one FSDP2 takes the host's accelerator,
    # which puts the shards of a CPU run on a GPU host on cuda:0.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    precision = MixedPrecisionPolicy()
    if runtime.bf16:
        precision = MixedPrecisionPolicy(param_dtype=runtime.dtype, reduce_dtype=torch.float32)
    blocks = {name for m in module.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    for layer in module.modules():
        if type(layer).__name__ in blocks:
            fully_shard(layer, mesh=mesh, mp_policy=precision)
    return fully_shard(module, mesh=mesh, mp_policy=precision)


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def gradient_sync(module: torch.nn.Module, sync: bool):
    """The context of one micro-batch's backward. DDP reduces only on the last (``sync``),
    accumulating locally before. FSDP2 reduce-scatters every micro-batch instead: accumulating
    unreduced would hold whole gradients on each rank, what sharding is there to avoid."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel) and not sync:
        return module.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def gathered(module: torch.nn.Module):
    """Inside the block every FSDP2 unit of ``module`` holds its whole weights and keeps them
    after each forward, so its submodules run with no collective, as many times as each rank
    needs (generation); resharded after. A no-op for a module that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    inner = [m for m in units if m is not module]  # the root keeps its own setting (FSDP2: no reshard)
    for unit in inner:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield module
    finally:
        for unit in units:
            unit.reshard()
        for unit in inner:
            unit.set_reshard_after_forward(True, recurse=False)
