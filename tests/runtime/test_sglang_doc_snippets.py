"""The trainer-side snippets of docs/sglang.md ("The trainer's side") and operator/README.md (the checkpoint
callback of "Suspend at a step boundary") run here as written, exec()'d from the documents themselves, against
a real redis-server and the SGLang stand-in (`colocate_runtime.sglang.standin`, its own process, with the
documented `--custom-weight-loader` entry points) over the shared-memory transport that stands in for CUDA IPC
on CPU. After the steps SGLang's parameters must equal the trainer's bit for bit.

The names a snippet leaves to the reader (the documents say which) come from `namespace`: `cfg`, `tensors`,
`train`, `steps`; for the in-place snippet `spec`, `megatron_layout`, `megatron_rank` and `model_chunks` of
a tiny Qwen3 (one chunk whose parameters are views of one buffer, as Megatron-core's DDP holds them), served
by a stand-in whose model has SGLang's fused Qwen3 parameters and the model's config, wired by the loader
itself from the trainer record; for the checkpoint snippet `save_checkpoint`, `rank`, and the `writer` and
`rollout` that docs/sglang.md's first snippet creates. The last tests show that an edited snippet reaches
exec() and fails there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from colocate_devcluster.localredis import RedisServer
from colocate_devcluster.processes import free_port
from colocate_operator import checkpoints
from colocate_operator.decide import CheckpointWrite
from colocate_runtime.colocated.config import ColocateConfig
from colocate_runtime.contract.checkpoint import CheckpointKeys, decode_step
from colocate_runtime.convert import (
    MegatronLayout,
    MegatronRank,
    SGLangLayout,
    inference_plan,
    model_spec,
    trainer_plan,
)
from colocate_runtime.sglang.client import SGLangClient
from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH
from colocate_runtime.sglang.standin import TinyLM
from tests.runtime.canonical_pieces import deliver
from tests.runtime.colocated_env import shm_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
SGLANG_DOC = ROOT / "docs" / "sglang.md"
OPERATOR_DOC = ROOT / "operator" / "README.md"
QWEN3 = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=200,  # Megatron pads it to 256 (128 x TP), SGLang to 256 (64): the loader cuts both
    intermediate_size=96,
    dtype="bfloat16",
)


# --- the snippets, from the documents --------------------------------------------------------------------


def section(text: str, heading: str) -> str:
    """The text under `heading` (a Markdown heading line, exactly) up to the next heading of its level."""
    level = heading.split(" ", 1)[0]
    match = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^{level} |\Z)", text, flags=re.S | re.M)
    if match is None:
        raise LookupError(f"no section {heading!r}")
    return match.group(1)


def blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of `language`, dedented (a block inside a list item is indented with it)."""
    found = re.findall(rf"^( *)```{language}\n(.*?)^\1```", text, flags=re.S | re.M)
    return [
        textwrap.dedent("\n".join(line[len(indent) :] for line in body.splitlines())) + "\n"
        for indent, body in found
    ]


def trainer_snippets(text: str) -> tuple[str, str]:
    """docs/sglang.md's two trainer blocks: the publish loop and the in-place loop."""
    loop, in_place = blocks(section(text, "## The trainer's side"), "python")[:2]
    assert "writer.publish(" in loop and "publish_in_place(" in in_place, "the blocks moved"
    return loop, in_place


def setup_of(loop: str) -> str:
    """The publish loop's lines before its step loop: the client, the rollout and the writer."""
    head, found, _ = loop.partition("\nfor step in ")
    assert found, "the publish loop has no step loop"
    return head + "\n"


def checkpoint_snippet(text: str) -> str:
    (snippet,) = [s for s in blocks(text, "python") if "CheckpointRequests" in s]
    return snippet


def run(snippet: str, namespace: dict[str, Any], origin: Path) -> None:
    """exec() a snippet as written; a traceback names the document."""
    exec(compile(snippet, str(origin.relative_to(ROOT)), "exec"), namespace)


# --- SGLang's side: the stand-in in its own process ------------------------------------------------------


@pytest.fixture
def colocated_env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    return shm_env(
        redis_server,
        tmp_path / "shm",
        COLOCATE_STEP_TIMEOUT_SECONDS="30",
        COLOCATE_HEARTBEAT_TTL_SECONDS="2",
        COLOCATE_IPC_PREFLIGHT="Wait",
        COLOCATE_VERIFY="SampledChecksum",
    )


@contextlib.contextmanager
def standin(env: dict[str, str], log: Path, model: str = "tiny") -> Iterator[str]:
    """The stand-in with the documented loader flags; `model="qwen3"`: SGLang's fused Qwen3 parameters (the
    same server, another model: `serve_qwen3`). Yields its URL (for `COLOCATE_SGLANG_URL`)."""
    port = free_port()
    loaders = ["--custom-weight-loader", LOADER_PATH, INIT_LOADER_PATH]
    if model == "tiny":
        argv = [sys.executable, "-m", "colocate_runtime.sglang.standin", "--port", str(port), *loaders]
    else:
        code = f"from tests.runtime.test_sglang_doc_snippets import serve_qwen3; serve_qwen3({port})"
        argv = [sys.executable, "-c", code]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def module_of(named: dict[str, torch.Tensor], *, requires_grad: bool) -> nn.Module:
    """A module whose named_parameters() are `named` (dotted names: submodules), sharing their storage."""
    root = nn.Module()
    for name, tensor in named.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        node.register_parameter(leaf, nn.Parameter(tensor, requires_grad=requires_grad))
    return root


def serve_qwen3(port: int) -> None:
    """The stand-in server over SGLang's Qwen3 parameters (fused qkv_proj and gate_up_proj, padded
    vocabulary) and the model's config, as SGLang's model has them: the loader wires itself from the trainer
    record."""
    from colocate_runtime.sglang.loader import load_colocated_step, start_colocated
    from colocate_runtime.sglang.standin import StandinState, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin %(message)s")
    torch.set_num_threads(1)
    iplan = inference_plan(model_spec(QWEN3), SGLangLayout(tp=1), 0)
    model = module_of(
        {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in iplan.param_shapes().items()},
        requires_grad=False,
    )
    model.config = dict(QWEN3)
    loaders = {LOADER_PATH: load_colocated_step, INIT_LOADER_PATH: start_colocated}
    serve(StandinState(model, loaders, on_crash=lambda why: os._exit(1)), "127.0.0.1", port)
    threading.Event().wait()


def engine_params(url: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """SGLang's parameters as it serves them (`/get_weights_by_name`; bf16 -> float32 is exact)."""
    client = SGLangClient(url)
    out = {}
    for name, shape in shapes.items():
        numel = int(torch.Size(shape).numel())
        out[name] = torch.tensor(client.get_weights_by_name(name, truncate_size=numel)).reshape(shape)
    return out


# --- the trainer's side: the names the documents leave to the reader --------------------------------------


def tiny_trainer(cfg: ColocateConfig, url: str, steps: int) -> dict[str, Any]:
    """`tensors`: the trainer's own TinyLM parameters (SGLang's names and shapes); `train(step)`: one
    optimizer step on them. The stand-in starts from the same seed-0 weights."""
    model = TinyLM(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.arange(16) % model.embed_tokens.shape[0]
    trained: list[int] = []

    def train(step: int) -> None:
        h = model.embed_tokens[ids[:-1]].float()
        h = h + nn.functional.silu(h @ model.up_proj.float().t()) @ model.down_proj.float().t()
        logits = (h * model.norm) @ model.lm_head.float().t()
        nn.functional.cross_entropy(logits, ids[1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        trained.append(step)

    cfg = dataclasses.replace(cfg, sglang_url=url)
    return {
        "cfg": cfg,
        "tensors": dict(model.named_parameters()),
        "train": train,
        "steps": steps,
        "model": model,
        "trained": trained,
    }


def assert_tiny_engine_matches(url: str, model: TinyLM) -> None:
    params = dict(model.named_parameters())
    got = engine_params(url, {n: tuple(p.shape) for n, p in params.items()})
    for name, p in params.items():
        assert torch.equal(got[name], p.detach().float()), f"{name}: SGLang's differs from the trainer's"
    assert not torch.equal(params["lm_head"].detach(), TinyLM(seed=0).lm_head.detach()), "nothing trained"


def close_writer(namespace: dict[str, Any]) -> None:
    writer = namespace.get("writer")
    if writer is not None:
        writer.close()


def run_publish_loop(loop: str, env: dict[str, str], tmp_path: Path) -> None:
    """The publish loop, 3 steps, then SGLang's weights against the trainer's."""
    with standin(env, tmp_path / "standin.log") as url:
        namespace = tiny_trainer(ColocateConfig.from_env(env), url, steps=3)
        try:
            run(loop, namespace, SGLANG_DOC)
        finally:
            close_writer(namespace)
        assert namespace["trained"] == [1, 2, 3] and namespace["report"].step == 3
        assert_tiny_engine_matches(url, namespace["model"])
        assert SGLangClient(url).get_weight_version() == "3"
    assert list((tmp_path / "shm").iterdir()) == []  # every step's buckets freed


def test_the_publish_loop_runs_as_written(colocated_env: dict[str, str], tmp_path: Path) -> None:
    loop, _ = trainer_snippets(SGLANG_DOC.read_text())
    run_publish_loop(loop, colocated_env, tmp_path)


def qwen3_trainer(cfg: ColocateConfig, url: str, steps: int) -> dict[str, Any]:
    """A Megatron-core rank of the tiny Qwen3 at TP 1: one model chunk whose parameters (Megatron's names,
    padded vocabulary) are views of one buffer, as DDP's `param_data`; `train(step)` an optimizer step."""
    spec = model_spec(QWEN3)
    layout, rank = MegatronLayout(), MegatronRank()
    params = [p for chunk in trainer_plan(spec, layout, rank).chunks for p in chunk.params]
    sizes = [int(torch.Size(p.shape).numel()) for p in params]
    buffer = (torch.randn(sum(sizes), generator=torch.Generator().manual_seed(1)) * 0.1).to(torch.bfloat16)
    views = buffer.split(sizes)
    chunk = module_of(
        {p.names[0]: v.view(p.shape) for p, v in zip(params, views, strict=True)}, requires_grad=True
    )
    optimizer = torch.optim.SGD(chunk.parameters(), lr=0.1)

    def train(step: int) -> None:
        loss = sum((p.float() - step / 100).square().sum() for p in chunk.parameters())
        loss.backward()
        optimizer.step()  # in place: the parameters stay views of the buffer
        optimizer.zero_grad()

    cfg = dataclasses.replace(cfg, sglang_url=url)
    return {
        "cfg": cfg,
        "tensors": None,  # the publish loop is not run here: the in-place loop replaces it
        "train": train,
        "steps": steps,
        "spec": spec,
        "megatron_layout": layout,
        "megatron_rank": rank,
        "model_chunks": [chunk],
        "buffer": buffer,
    }


def test_the_in_place_loop_runs_as_written(colocated_env: dict[str, str], tmp_path: Path) -> None:
    loop, in_place = trainer_snippets(SGLANG_DOC.read_text())
    with standin(colocated_env, tmp_path / "standin.log", model="qwen3") as url:
        namespace = qwen3_trainer(ColocateConfig.from_env(colocated_env), url, steps=3)
        before = namespace["buffer"].clone()
        try:
            run(setup_of(loop), namespace, SGLANG_DOC)
            run(in_place, namespace, SGLANG_DOC)
        finally:
            close_writer(namespace)
        assert namespace["report"].step == 3 and SGLangClient(url).get_weight_version() == "3"
        assert not torch.equal(namespace["buffer"], before), "nothing trained"
        # SGLang's side placed the canonical pieces itself, from the record the snippet writes.
        assert "automatic wiring, worker 0: local path" in (tmp_path / "standin.log").read_text()

        # SGLang's fused parameters against the trainer's, converted by the reference path (convert + write).
        spec = namespace["spec"]
        iplan = inference_plan(spec, SGLangLayout(tp=1), 0)
        tplan = trainer_plan(spec, namespace["megatron_layout"], namespace["megatron_rank"])
        want = deliver(iplan, tplan.convert([c.state_dict() for c in namespace["model_chunks"]]))
        got = engine_params(url, iplan.param_shapes())
        # Compare what SGLang reads (its padded vocabulary rows hold garbage after a release, as in SGLang).
        want_views = {s.name: v for s, v in iplan.read(want)}
        for shard, view in iplan.read(got):
            assert torch.equal(view, want_views[shard.name].float()), shard.name


def test_the_checkpoint_callback_runs_as_written_and_stops_at_the_step_boundary(
    colocated_env: dict[str, str], tmp_path: Path, redis_server: RedisServer
) -> None:
    """The operator asks for a checkpoint during step 2: the loop checkpoints after step 2 and stops; run
    again (a resume), it continues with step 3. Between the two runs SGLang holds step 2's weights."""
    loop, _ = trainer_snippets(SGLANG_DOC.read_text())
    snippet = checkpoint_snippet(OPERATOR_DOC.read_text())
    cfg = ColocateConfig.from_env(colocated_env)
    operator = redis_server.client()
    records = CheckpointKeys(cfg.namespace, cfg.job)
    with standin(colocated_env, tmp_path / "standin.log") as url:
        namespace = tiny_trainer(cfg, url, steps=4)
        saved: list[int] = []
        train = namespace["train"]

        def train_and_get_suspended(step: int) -> None:
            train(step)
            if step == 2:  # the operator's suspend, while the step runs
                checkpoints.write(operator, records, CheckpointWrite(request_id="suspend-1", reason="test"))

        namespace.update(save_checkpoint=saved.append, rank=0, train=train_and_get_suspended)
        try:
            run(setup_of(loop), namespace, SGLANG_DOC)
            run(snippet, namespace, OPERATOR_DOC)
            assert namespace["trained"] == [1, 2] and saved == [2]
            assert checkpoints.read(operator, records).acks == {"0": ("suspend-1", 2)}
            assert decode_step(operator.get(records.resume)) == 2
            assert_tiny_engine_matches(url, namespace["model"])

            run(snippet, namespace, OPERATOR_DOC)  # resumed: the stale request does not stop it
            assert namespace["trained"] == [1, 2, 3, 4] and saved == [2]
            assert_tiny_engine_matches(url, namespace["model"])
            assert SGLangClient(url).get_weight_version() == "4"
        finally:
            close_writer(namespace)


# --- an edited snippet fails ------------------------------------------------------------------------------


PUBLISH = "    pending = writer.publish(step, tensors, weight_version=str(step))\n"


@pytest.mark.parametrize(
    ("old", "new", "error", "match"),
    [
        # Published before the training step: SGLang serves the weights of the step before.
        ("    train(step)\n" + PUBLISH, PUBLISH + "    train(step)\n", AssertionError, "differs"),
        ("tensors, weight_version=str(step))", "tensors, version=str(step))", TypeError, "version"),
    ],
    ids=["publish-before-train", "wrong-keyword"],
)
def test_an_edited_snippet_fails(
    colocated_env: dict[str, str], tmp_path: Path, old: str, new: str, error: type[Exception], match: str
) -> None:
    text = SGLANG_DOC.read_text()
    assert text.count(old) == 1
    loop, _ = trainer_snippets(text.replace(old, new))
    with pytest.raises(error, match=match):
        run_publish_loop(loop, colocated_env, tmp_path)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            "from colocate_runtime.sglang.rollout import ColocatedRollout",
            "from colocate_runtime import Rollout",
        ),
        ("writer.publish_in_place(step, layout,", "writer.publish_in_place(step, plan,"),
    ],
)
def test_the_extraction_takes_the_documents_text(old: str, new: str) -> None:
    """What runs is the document's text: an edit shows up in the extracted blocks, and a section or block
    that is gone is an error, not a test that runs nothing."""
    text = SGLANG_DOC.read_text()
    assert old in text
    assert any(new in block for block in trainer_snippets(text.replace(old, new)))
    with pytest.raises(LookupError):
        trainer_snippets(text.replace("## The trainer's side", "## Trainer"))
    with pytest.raises(ValueError):
        trainer_snippets(
            text.replace("```python\nfrom colocate_runtime.convert import", "```\nfrom x import")
        )
