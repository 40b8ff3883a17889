"""A vLLM weight-transfer backend over TCP, ``grpo_fast_tcp``: the trainer's weights reach a
vLLM server through vLLM's own weight-transfer API on any device, CPU included.

vLLM's shipped backends need a GPU (NCCL, CUDA IPC); this one registers through vLLM's
extension point (``WeightTransferEngineFactory`` for the server's worker,
``WeightTransferTrainerFactory`` for the trainer) and drives the same handshake over the
server's HTTP routes (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``):

    trainer                                           server (its worker)
    listen on (host, port)
    POST /update_weights {host, port, names, ...}  ->  connect to (host, port)
    send every tensor's bytes, in metadata order   ->  receive all of them, then load them
    POST /finish_weight_update {weight_version}    ->  the server reports this version

One connection per update, so several trainer-side clients (training, evaluation) may push to
one server. The worker receives the whole model before loading any of it (one copy of the
weights in the server's memory while it loads): a connection that breaks mid-way leaves the
server on its old weights and its old version. Loading is vLLM's in-place reload, the path the
colocated engine's ``reload_weights`` takes, so a float32 server holds the trainer's weights
bit for bit.

The server imports this module through ``--worker-extension-cls`` (:class:`ServerExtension`,
what ``grpo-fast serve`` passes): the worker imports that class by name in its own process,
however vLLM started it, so the backend is registered before the worker builds its engine.
"""

import dataclasses
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import torch
import vllm

try:  # vLLM's extension point, and the in-place reload its worker-side engines load with
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightSource,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.model_executor.model_loader.reload.inplace import reload_weights
except ImportError as exc:
    raise ImportError(
        f"vllm_mode='server' needs vLLM's weight-transfer API as vLLM 0.32 has it; this is vLLM {vllm.__version__}: "
        f"{exc}"
    ) from exc

BACKEND = "grpo_fast_tcp"
_CHUNK = 1 << 22  # bytes a socket read may fill at once
_POLL_S = 0.2  # how often the trainer, waiting for the server to connect, looks whether it gave up


@dataclasses.dataclass
class TCPInitInfo(WeightTransferInitInfo):
    """The worker's side of the handshake: how long it waits for the trainer's bytes."""

    timeout_s: float = 300.0


@dataclasses.dataclass
class TCPUpdateInfo(WeightTransferUpdateInfo):
    """One update: where the trainer listens, and the tensors it sends there in this order."""

    host: str
    port: int
    names: list
    dtype_names: list
    shapes: list

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per tensor, got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}"
            )


def _receive_exactly(connection: socket.socket, buffer: memoryview) -> None:
    """Fills ``buffer`` from ``connection``; ConnectionError when the trainer closes first."""
    filled = 0
    while filled < len(buffer):
        n = connection.recv_into(buffer[filled : filled + _CHUNK])
        if n == 0:
            raise ConnectionError(f"the trainer closed the weight stream after {filled} of {len(buffer)} bytes")
        filled += n


class TCPWeightTransferEngine(WeightTransferEngine[TCPInitInfo, TCPUpdateInfo]):
    """The server's (worker's) side: receives a whole update, then reloads the model from it."""

    init_info_cls = TCPInitInfo
    update_info_cls = TCPUpdateInfo
    timeout_s = TCPInitInfo.timeout_s  # until a trainer's init says otherwise

    def init_transfer_engine(self, init_info: TCPInitInfo) -> None:
        self.timeout_s = init_info.timeout_s

    def start_weight_update(self) -> None:
        """Nothing to prepare: :meth:`receive_weights` reloads in one call once all bytes arrived."""

    def finish_weight_update(self) -> None:
        """Nothing left: the reload finished with the last update."""

    def update_weights(self, update_info: dict) -> None:
        # the base class synchronizes torch.accelerator, which raises on a machine without one
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: TCPUpdateInfo) -> None:
        staged = []
        with socket.create_connection((update_info.host, update_info.port), timeout=self.timeout_s) as connection:
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                dtype = getattr(torch, dtype_name)
                data = torch.empty(torch.Size(shape).numel() * dtype.itemsize, dtype=torch.uint8)
                _receive_exactly(connection, memoryview(data.numpy()))
                staged.append((name, data.view(dtype).reshape(shape).to(self.device)))
        reload_weights(self.vllm_config, self.model, staged, weights_path=None, is_checkpoint_format=True)

    def shutdown(self) -> None:
        """Holds no connection between updates."""


@dataclasses.dataclass
class TCPTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: ``host`` is its address as the server reaches it (127.0.0.1 on one
    machine, the trainer node's name across nodes); it listens there on a free port."""

    backend: ClassVar[str] = BACKEND
    host: str = "127.0.0.1"
    timeout_s: float = 300.0


class TCPTrainerWeightTransferEngine(TrainerWeightTransferEngine[TCPTrainerInitInfo]):
    """The trainer's side: each :meth:`send_weights` streams the source's tensors to the server
    while the server's ``/update_weights`` call is in flight, then finishes the update."""

    init_info_cls = TCPTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, is_sender: bool = True, host: str, timeout_s: float):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.host, self.timeout_s = host, timeout_s

    @classmethod
    def trainer_init(cls, init_info: TCPTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError(f"the {BACKEND} weight transfer needs a WeightSource (the policy's weights)")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            host=init_info.host,
            timeout_s=init_info.timeout_s,
        )
        if engine.is_sender:
            client.init_weight_transfer_engine(dict(timeout_s=init_info.timeout_s))
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        """Pushes every tensor of the source; the server reports ``weight_version`` after. The
        sender alone: its whole weights are every rank's (a sharded source, whose tensors every
        rank gathers together, is not supported)."""
        if not self.is_sender:
            return
        meta = self.source.metadata()
        with socket.create_server((self.host, 0)) as listener:
            info = TCPUpdateInfo(
                host=self.host,
                port=listener.getsockname()[1],
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta],
            )
            self.client.start_weight_update()
            with ThreadPoolExecutor(max_workers=1) as pool:
                # the server's worker connects and reads while its /update_weights call is in flight
                update = pool.submit(self.client.update_weights, dataclasses.asdict(info))
                connection = self._accept(listener, update)
                with connection:
                    for (_, tensor), expected in zip(self.source, meta):
                        data = tensor.detach().to("cpu").contiguous()
                        if tuple(data.shape) != expected.shape or data.dtype != expected.dtype:
                            raise ValueError(f"the weight {expected.name!r} changed shape or dtype during the push")
                        connection.sendall(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
                update.result()
        self.client.finish_weight_update(weight_version)

    def _accept(self, listener: socket.socket, update) -> socket.socket:
        """The server's connection; the server's error at once if its ``update`` call failed
        before it connected (a refused update never connects), TimeoutError after timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        listener.settimeout(_POLL_S)
        while True:
            try:
                return listener.accept()[0]
            except TimeoutError:
                if update.done():
                    update.result()
                    raise ConnectionError("the server finished its update without connecting for the weights")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the server did not connect for the weights within {self.timeout_s} s")


class ServerExtension:
    """Passed to ``vllm serve --worker-extension-cls``: importing it registers the backend in
    the worker's process; :meth:`grpo_fast_model_info` tells a trainer what model it serves."""

    def grpo_fast_model_info(self) -> dict:
        """The served model's architectures, the config fields that fix its weights' shapes, and
        its log-prob mode."""
        model_config = self.model_runner.model_config
        hf = model_config.hf_text_config.to_dict()
        return dict(
            config={key: hf.get(key) for key in SHAPE_KEYS},
            architectures=list(model_config.architectures),
            logprobs_mode=model_config.logprobs_mode,
        )


# the config fields that fix every weight's shape (a model config without one leaves it None)
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)

WeightTransferEngineFactory.register_engine(BACKEND, TCPWeightTransferEngine)
WeightTransferTrainerFactory.register_engine(BACKEND, TCPTrainerWeightTransferEngine)
