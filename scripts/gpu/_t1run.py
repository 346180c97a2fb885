"""bench_t1's model, batch, variant runner and launch environment (``Env``): what each variant
is and how one of its steps runs."""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import os
from pathlib import Path
from typing import Any

import _gpulib as gl
from _t1vocab import (
    BASE,
    BASE_C,
    BASE_CR,
    BUCKET_MB,
    CAPTURE_WARMUP,
    CAPTURED,
    COMPILED,
    DDP,
    DDP_C,
    DDP_VIEWS,
    DDPS,
    FLAT_G,
    HVD,
    HVD_ALT,
    HVD_ASYNC,
    HVD_C,
    HVD_C_ALT,
    HVD_CO,
    HVD_CR,
    HVD_CS,
    HVD_CS4,
    HVD_CTA,
    HVD_G,
    HVD_G_IPC,
    HVD_G_PRIO,
    HVD_GO,
    HVD_GR,
    HVD_GR_IPC,
    HVD_GS,
    HVD_IPC,
    HVD_NEG,
    HVD_PRIO,
    HVD_REG,
    HVDS,
    ORDER_BUCKET_MB,
    OVERLAP,
    PLAIN_G,
    PLAIN_GR,
    REGIONED,
    SHORT,
    SPLIT,
    SPLIT_COARSE,
    is_compiled,
)
from mpi4py import MPI


# -- model and data ------------------------------------------------------------------------
def build_model(torch: Any, name: str) -> Any:
    """The model by name (same weights on every rank: built right after seeding)."""
    nn = torch.nn
    if name == "tiny":
        return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16),
                             nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1000))
    if name == "g4":
        return nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(24)])
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
    if name == "gpt2":  # GPT-2 small from its config (no download), dropout off (comparable)
        from transformers import GPT2Config, GPT2LMHeadModel

        # use_cache off, as training runs it: with it on, every forward makes a cache object
        # that each block updates, so compiled blocks recompile per layer until torch's
        # recompile limit leaves the rest eager (hvd.compile_regions warns of it).
        cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        return GPT2LMHeadModel(cfg)
    from torchvision import models

    return getattr(models, name)()


def head_loss(torch: Any, head: Any) -> Any:
    """A language model's head and its causal loss as one module (Hugging Face's
    ``ForCausalLMLoss`` for labels with no ignored position: float32 logits, the next
    token's cross entropy, the mean)."""

    class HeadLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = head

        def forward(self, hidden: Any, labels: Any) -> Any:
            logits = self.head(hidden).float()
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                     labels[:, 1:].flatten())

    return HeadLoss()


def make_batch(torch: Any, args: argparse.Namespace, rank: int, device: Any) -> tuple[Any, Any]:
    """This rank's fixed batch (differs per rank, the same every run)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    if args.model == "g4":
        x = torch.randn(args.batch_size, 4096, generator=g)
        y = torch.randn(args.batch_size, 4096, generator=g)
    elif args.model == "transformer":
        x = torch.randn(args.batch_size, args.seq_len, 768, generator=g)
        y = torch.randn(args.batch_size, args.seq_len, 768, generator=g)
    elif args.model == "gpt2":
        x = torch.randint(0, 50257, (args.batch_size, args.seq_len), generator=g)
        y = x
    else:
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
        y = torch.randint(0, 1000, (args.batch_size,), generator=g)
    return x.to(device), y.to(device)


def registration_buckets(model: Any, cap_mb: float) -> list[list[Any]]:
    """The optimizer's layout before the tail cap and the re-forming after the first step
    (0afb945): its own bucketing of the parameters in registration order, no tail cap."""
    from hvdlite.torch._buckets import auto_buckets, mib_bytes

    return auto_buckets([p for p in model.parameters() if p.requires_grad],
                        mib_bytes("--bucket-cap-mb", cap_mb))


class Runner:
    """One variant: its own model from the initial weights, optimizer and step."""

    def __init__(self, env: Env, kind: str) -> None:
        torch, args = env.torch, env.args
        self.env, self.kind = env, kind
        self.model = build_model(torch, args.model).to(env.device)
        self.model.load_state_dict(env.init_state)
        self.model.train()
        self.forward = self.model
        if kind in DDPS:
            from torch.nn.parallel import DistributedDataParallel

            ids = [env.device.index] if env.cuda else None
            self.forward = DistributedDataParallel(
                self.model, device_ids=ids, gradient_as_bucket_view=kind == DDP_VIEWS,
                bucket_cap_mb=ORDER_BUCKET_MB.get(kind))
        regions = None
        cap = BUCKET_MB.get(kind, args.bucket_cap_mb)  # the optimizer's, and compile_overlap's
        if kind in REGIONED:
            regions = env.hvd.compile_regions(self.model, dynamic=False)  # fixed shapes
            if args.model == "gpt2":
                # The head with its loss, one region (tied to the embedding, its weight waits
                # in the last bucket), its matmuls padded: the 50257-wide head ran cuBLAS's
                # unaligned GEMMs eager (run 99), compiled alone and compiled with its loss
                # (7.9 ms a step; inductor did not pad them there), and padded as the whole
                # model's compile has them only with force_shape_pad (runs 104-106).
                self.head_loss = head_loss(torch, self.model.lm_head)  # outside the model
                self.head_loss.compile(options={"force_shape_pad": True})
                regions.append(self.head_loss)
        elif kind in SPLIT:  # cut where the optimizer's buckets fall (the same cap, or a multiple)
            coarse = SPLIT_COARSE if kind == HVD_CS4 else 1
            self.forward = env.hvd.compile_split(self.forward, args.bucket_cap_mb * coarse)
        elif kind in OVERLAP:  # the buckets found in the backward with the optimizer's cap
            self.forward = env.hvd.compile_overlap(self.model, cap)
        elif kind in COMPILED or (kind in CAPTURED and args.compile == "on"):
            self.forward = torch.compile(self.forward)
        opt = torch.optim.SGD(self.model.parameters(), lr=args.lr)
        if kind in HVDS:  # as a user writes it: nothing but the wrap (HVD_ALT flips views)
            named = [(f"t1{HVDS.index(kind)}.{n}", p) for n, p in self.model.named_parameters()]
            flip = kind in (HVD_ALT, HVD_C_ALT)
            extra: dict[str, Any] = {"gradient_as_bucket_view": not env.views_default} \
                if flip else {}
            if regions is not None:
                extra["groups"] = env.hvd.region_groups(self.model, regions,
                                                        args.bucket_cap_mb)
            elif kind == HVD_REG:
                extra["groups"] = registration_buckets(self.model, args.bucket_cap_mb)
            if kind in BUCKET_MB:
                extra["bucket_cap_mb"] = cap
            opt = env.hvd.DistributedOptimizer(opt, named_parameters=named, **extra)
        self.opt = opt
        self.graph: Any = None  # the captured step (CAPTURED variants), made at the first step
        if kind == FLAT_G:
            self._flat_grads()
        # The knobs its first step runs with (the schedule is opened at the end of it).
        self.first: dict[str, Any] = {"optimizer_schedule": False} if kind == HVD_NEG else {}
        for n, v in HVD_CTA.items():
            if kind == v:
                self.first = {"optimizer_max_ctas": n}
        if kind in (HVD_PRIO, HVD_G_PRIO):
            self.first = {"stream_priority": "normal"}
        if kind in (HVD_IPC, HVD_G_IPC, HVD_GR_IPC):
            self.first = {"schedule_transport": "ipc"}
        mse = args.model in ("g4", "transformer")
        self.loss = torch.nn.functional.mse_loss if mse else torch.nn.functional.cross_entropy
        self.amp = args.autocast == "bf16"
        # --share-gpu: plain torch is one process (rank 0) on every rank's batch.
        self.idle = kind == BASE and args.share_gpu and env.rank != 0
        self.x, self.y = (env.x_all, env.y_all) if kind == BASE and args.share_gpu else \
            (env.x, env.y)

    def _loss(self) -> Any:
        if self.kind in REGIONED and self.env.args.model == "gpt2":
            hidden = self.model.transformer(self.x).last_hidden_state
            return self.head_loss(hidden, self.y)
        if self.env.args.model == "gpt2":
            return self.forward(self.x, labels=self.y).loss
        return self.loss(self.forward(self.x), self.y)

    def _flat_grads(self) -> None:
        """FLAT_G: every gradient a view of one flat buffer, reduced by one allreduce."""
        torch = self.env.torch
        params = list(self.model.parameters())
        self.grad_buffer = torch.zeros(sum(p.numel() for p in params), device=self.env.device)
        offset = 0
        for p in params:
            p.grad = self.grad_buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def _eager_step(self) -> None:
        torch = self.env.torch
        if self.kind == FLAT_G:
            self.opt.zero_grad(set_to_none=False)
        else:
            self.opt.zero_grad()
        if self.amp:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = self._loss()
        else:
            loss = self._loss()
        loss.backward()
        if self.kind == FLAT_G:
            torch.distributed.all_reduce(self.grad_buffer)
            self.grad_buffer.div_(self.env.size)
        self.opt.step()

    def _captured_step(self) -> None:
        torch = self.env.torch
        if self.graph is not None:
            self.graph()
            return
        dump = self._dump_path()
        if self.kind in HVDS:  # every captured hvdlite step: as a user writes it
            # Its first warm-up step opens the schedule, under the variant's knobs.
            first, self.first = self.first, {}
            with self.env.knobs(**first):
                self.graph = self.env.hvd.make_graphed_step(lambda: self._eager_step(),
                                                            optimizer=self.opt,
                                                            warmup_steps=CAPTURE_WARMUP,
                                                            debug_dump=dump)
            return
        side = torch.cuda.Stream()  # torch's recipe: warm up on a side stream, then capture
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP):
                self._eager_step()
        torch.cuda.current_stream().wait_stream(side)
        if dump is None:
            graph = torch.cuda.CUDAGraph()
        else:  # a graph kept to be written as DOT, as make_graphed_step keeps its own
            from hvdlite.torch.graphs import _dump, _kept_graph

            graph, kept = _kept_graph()
        with torch.cuda.graph(graph):
            self._eager_step()
        if dump is not None:
            _dump(graph, kept, dump)
        self.graph = graph.replay

    def _dump_path(self) -> str | None:
        """--graph-dump: rank 0's captured graph of this variant as DOT (the first capture of
        the launch only: the correctness pass's)."""
        root = self.env.args.graph_dump
        if not root or self.env.rank != 0:
            return None
        short = next(k for k, v in SHORT.items() if v == self.kind)
        path = Path(root) / f"{self.env.args.model}_{short}.dot"
        if path.exists():
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        return str(path)

    def step(self) -> None:
        if self.idle:
            return
        if self.kind in CAPTURED:
            self._captured_step()
        elif self.first:  # the agreed schedule is decided at the end of the first step
            first, self.first = self.first, {}
            with self.env.knobs(**first):
                self._eager_step()
        else:
            self._eager_step()

    def steps(self, n: int) -> None:
        """``n`` steps (asynchronous completion on for the variant that tests it)."""
        rt = self.env.runtime() if self.kind == HVD_ASYNC else None
        if rt is not None:
            rt._async = True
        try:
            for _ in range(n):
                self.step()
        finally:
            if rt is not None:
                self.env.sync()
                rt._async = False

    def flat(self) -> Any:
        return self.env.torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


class Env:
    """The launch: MPI, torch device, torch.distributed, hvdlite.torch, initial weights."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.comm, self.rank, self.size, self.local_rank, self.local_size = gl.join_launch(args)
        import torch

        self.torch = torch
        self.cuda = not args.no_cuda
        why = ""
        if args.model == "gpt2":
            try:
                import transformers  # noqa: F401
            except ImportError:
                why = "--model gpt2 needs transformers"
        elif args.model not in ("tiny", "g4", "transformer"):
            try:
                import torchvision  # noqa: F401
            except ImportError:
                why = f"--model {args.model} needs torchvision (or pass --model tiny)"
        if self.cuda and not why:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count < (1 if args.share_gpu else self.local_size):
                why = (f"{count} CUDA devices visible for {self.local_size} ranks on this host "
                       "(NCCL and DDP need one GPU per rank; --no-cuda runs on the CPU)")
        gl.check_all(self.comm, not why, "setup", why)
        if self.cuda:
            self.device = torch.device("cuda", 0 if args.share_gpu else self.local_rank)
            torch.cuda.set_device(self.device)
            if args.model == "g4":  # G4's reference: float32 with TF32 matmuls
                torch.backends.cuda.matmul.allow_tf32 = True
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.local_size))
        self._dist_init()
        import hvdlite.torch as hvd

        self.hvd = hvd
        knobs: dict[str, Any] = dict.fromkeys(gl.shortcut_knobs(), False)
        hvd.init(self.comm, **knobs)
        import inspect

        self.views_default = bool(inspect.signature(hvd.DistributedOptimizer).parameters[
            "gradient_as_bucket_view"].default)
        gl.check_all(self.comm, hvd.size() == self.size, "hvdlite size",
                     f"hvd.size() {hvd.size()} != MPI size {self.size}")
        torch.manual_seed(args.seed)
        model = build_model(torch, args.model).to(self.device)
        self.init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.kernel_overlap: dict[str, dict[str, float]] = {}  # --kernel-trace's, this rank
        self.routes: dict[str, str] = {}  # each hvdlite variant's route after warm-up (rank 0)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.grad_shapes = [tuple(p.shape) for p in model.parameters()]
        self.batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                              for m in model.modules())
        init = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        del model
        digests = self.comm.allgather(digest(init))
        gl.check_all(self.comm, len(set(digests)) == 1, "initial weights equal on every rank",
                     f"digests {digests}")
        self.init_flat = init
        self.x, self.y = make_batch(torch, args, self.rank, self.device)
        self.x_all, self.y_all = self.x, self.y
        if args.share_gpu and self.rank == 0:
            pairs = [make_batch(torch, args, r, self.device) for r in range(self.size)]
            self.x_all = torch.cat([x for x, _ in pairs])
            self.y_all = torch.cat([y for _, y in pairs])

    def knobs(self, **changes: Any) -> Any:
        """A context in which the engine's config has ``changes`` (read where the optimizer
        reads them: the schedule knob at the end of its first step)."""
        import contextlib
        import dataclasses

        from hvdlite._engine import default_engine

        @contextlib.contextmanager
        def ctx() -> Any:
            engine = default_engine()
            old = engine.config
            engine.config = dataclasses.replace(old, **changes)
            try:
                yield
            finally:
                engine.config = old
        return ctx()

    def runtime(self) -> Any:
        """hvdlite's device runtime (None on the CPU): the async-completion variant sets its
        knob for its own rounds."""
        if not self.cuda:
            return None
        from hvdlite._engine import default_engine

        return default_engine().gpu_runtime()

    def _dist_init(self) -> None:
        torch = self.torch
        port = self.comm.bcast(gl.free_port() if self.rank == 0 else None, root=0)
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           "RANK": str(self.rank), "WORLD_SIZE": str(self.size),
                           "LOCAL_RANK": str(self.local_rank)})
        why = ""
        try:
            torch.distributed.init_process_group(
                "nccl" if self.cuda and not self.args.share_gpu else "gloo",
                init_method="env://", rank=self.rank,
                world_size=self.size, timeout=_dt.timedelta(seconds=60))
            t = torch.full((4,), float(self.rank + 1), device=self.device)
            torch.distributed.all_reduce(t)
            want = float(self.size * (self.size + 1) // 2)
            if not bool((t == want).all()):
                why = f"all_reduce check: got {t.tolist()}, expected {want}"
        except Exception as exc:  # DDP is a required baseline: refuse with the reason
            why = f"torch.distributed unusable: {exc!r}"
        gl.check_all(self.comm, not why, "torch.distributed", why)

    def variants(self) -> list[str]:
        """Plain torch, hvdlite's variants, DDP's; compiled ones with --compile on (async
        completion is left out: the optimizer's step is stream-ordered in both modes)."""
        out = [BASE, HVD, HVD_ALT, HVD_NEG, DDP, DDP_VIEWS]
        if self.args.no_neg or not self.cuda:
            out.remove(HVD_NEG)
        if self.args.compile == "on":
            out += [BASE_C, HVD_C, HVD_C_ALT, HVD_CR, DDP_C]
        if self.args.captured:
            out += [PLAIN_G, HVD_G, FLAT_G] + ([HVD_GR] if self.args.compile == "on" else [])
        if self.args.variants:
            keep = {SHORT[v.strip()] for v in self.args.variants.split(",")}
            if any(is_compiled(k, self.args) for k in keep):  # their references come along
                keep |= {BASE_C, DDP_C}
            opt_in = [*HVD_CTA.values(), HVD_PRIO, HVD_G_PRIO, HVD_IPC, HVD_G_IPC,  # if asked
                      HVD_GR_IPC, BASE_CR, PLAIN_GR, HVD_REG, HVD_CS, HVD_GS, HVD_CS4, HVD_CO,
                      HVD_GO, *BUCKET_MB]
            out = [v for v in [*out, *opt_in] if v in keep or v in (BASE, HVD, DDP)]
        return out

    def barrier(self) -> None:
        self.comm.Barrier()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def max_over_ranks(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=MPI.MAX))


def digest(t: Any) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
