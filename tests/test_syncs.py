"""No host syncs in a training step (issue 20 item 3): the host reads the device only at the
end of a log window. On the CPU a device sync cannot be seen, so a counter stands in for it:
every call that on a GPU makes the host wait for the device (a value read: item, tolist,
bool, int, float, format, cpu, numpy; a data-dependent shape: nonzero, masked_select,
boolean indexing, unique, bincount, repeat_interleave without output_size). On CUDA,
torch.cuda.set_sync_debug_mode counts the real ones."""

import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from helpers import train_in_rank
from ndtrain.testing import run_ranks

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__format__", "cpu", "numpy",
         "nonzero", "masked_select", "unique", "unique_consecutive", "bincount"}


def _is_host_wait(name: str, args, kwargs) -> bool:
    if name in READS:
        return True
    if name == "repeat_interleave":  # tensor repeats: the output's size is their sum
        return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) and \
            kwargs.get("output_size") is None
    if name == "__getitem__":  # a boolean mask: the output's size is its count
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange"}


class HostWaits(TorchFunctionMode):
    """Records (step, operation) for every call that would make the host wait for a GPU.

    Tensors that would live on the host on a GPU too are told apart and never counted: what
    `.cpu()` returns, what a factory makes without naming a device (engine code always names
    the mesh's), and what is computed from such tensors only, except a copy to a device (the
    MoE dispatch's split sizes, read once, then used on the host)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, str]] = []
        self.step = -1
        self.paused = False
        self.on_host = lambda: set()  # ids of tensors that live on the host on a GPU too
        self.host: set[int] = set()  # ids of live host tensors (a finalizer forgets each)

    def _is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (id(t) in self.host or id(t) in self.on_host())

    def _mark_host(self, t: torch.Tensor) -> None:
        if id(t) not in self.host:
            self.host.add(id(t))
            weakref.finalize(t, self.host.discard, id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not self.paused and _is_host_wait(name, args, kwargs) and not self._is_host(args[0] if args else None):
            self.calls.append((self.step, name))
        out = func(*args, **kwargs)
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        made_on_host = name in FACTORIES and "device" not in kwargs  # the engine names its device
        derived = name not in ("to", "cuda", "pin_memory") and inputs and all(self._is_host(t) for t in inputs)
        if name == "cpu" or made_on_host or derived:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._mark_host(t)
        return out

    def per_step(self, steps: int) -> list[list[str]]:
        return [[name for s, name in self.calls if s == step] for step in range(steps)]


def counting(counter: HostWaits):
    """before_fit: attribute calls to the step being run (a step's window end counts for it);
    the host's data preparation (task rows, the target count, before the copy to the device)
    is not device work and is left out, and so are AdamW's step counters, which torch keeps on
    the host unless the optimizer is fused (it is on CUDA: train/optim.py)."""
    def install(trainer):
        optimizer = trainer.stepper.optimizer
        counter.on_host = lambda: {id(s["step"]) for s in optimizer.state.values() if "step" in s}
        run_step, local_batch = trainer.train_step, trainer.local_batch

        def train_step(step):
            counter.step = step
            return run_step(step)

        def host_batch(split, step, *part):
            counter.paused = True
            try:
                return local_batch(split, step, *part)
            finally:
                counter.paused = False
        trainer.train_step, trainer.local_batch = train_step, host_batch
    return install


STEPS = ["train.steps=3", "train.log_every=10", "train.micro_batch=2"]
LAYOUTS = {  # the default tier
    "zero3": ["parallel.zero=3"],
    "tp2-sp": ["parallel.tp=2", "parallel.sp=true"],
    "pp2-1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "ep2-moe": ["model.preset=tiny-moe", "parallel.ep=2"],
}
MORE_LAYOUTS = {  # the slow tier
    "dp2": ["parallel.dp=2"],
    "cp2-ring": ["parallel.cp=2", "parallel.cp_impl=ring"],
    "cp2-ulysses": ["parallel.cp=2", "parallel.cp_impl=ulysses"],
    "dp2-recompute": ["parallel.dp=2", "train.recompute=full"],
    "zero2-selective": ["parallel.zero=2", "train.recompute=selective"],
}


def _host_waits(data_dir, layouts):
    out = {}
    for name, overrides in layouts.items():
        counter = HostWaits()
        with counter:
            train_in_rank(STEPS + overrides, data_dir, before_fit=counting(counter))
        out[name] = counter.per_step(3)
    return out


def test_a_step_off_the_log_steps_never_waits_for_the_device(tiny_data):
    """Step 1 of 3 (log_every 10: steps 0 and 2 end a window): no host wait at all in a dense
    model. An expert-parallel MoE block reads one thing per forward: the all-to-all's split
    sizes (4 MoE blocks × 2 micro-batches = 8 reads), and nothing else (the counts for its
    experts come with them). The window ends do read: the control that the counter sees
    what the trainer does there."""
    _check(run_ranks(_host_waits, 2, tiny_data, LAYOUTS))


@pytest.mark.slow
def test_a_step_off_the_log_steps_never_waits_on_more_layouts(tiny_data):
    """The same on DP, CP (ring and Ulysses) and the recomputation modes."""
    _check(run_ranks(_host_waits, 2, tiny_data, MORE_LAYOUTS))


def _check(results):
    for rank, result in enumerate(results):
        for name, steps in result.items():
            expected = ["tolist"] * 8 if name == "ep2-moe" else []
            assert steps[1] == expected, (rank, name, steps[1])
            assert len(steps[2]) > len(expected), (rank, name, steps[2])


def _fp16_waits(data_dir):
    counter = HostWaits()
    with counter:
        train_in_rank(STEPS + ["train.precision=fp16"], data_dir, before_fit=counting(counter))
    return counter.per_step(3)


def test_fp16_waits_once_per_step_for_the_loss_scale(tiny_data):
    """fp16 reads one value per step: whether the gradients overflowed, which decides the
    step and the next step's loss scale (docs/architecture.md, "Host syncs")."""
    steps = run_ranks(_fp16_waits, 1, tiny_data)[0]
    assert steps[1] == ["item"], steps[1]


@pytest.mark.cuda
def test_cuda_step_has_no_synchronising_call(tiny_data):
    """On a GPU: torch's own sync detector raises on any synchronising call during step 1
    (a dense model, bf16)."""
    def strict(trainer):
        run_step = trainer.train_step

        def train_step(step):
            torch.cuda.set_sync_debug_mode("error" if step == 1 else "default")
            try:
                return run_step(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        trainer.train_step = train_step
    train_in_rank(STEPS + ["train.precision=bf16", "run.device=cuda"], tiny_data, before_fit=strict)
