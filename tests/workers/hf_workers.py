"""Rank functions of the Hugging Face round-trip tests (issue 15): a tiny Llama built offline,
sharded with FSDP2 on gloo ranks; logits are compared with the unsharded model's."""

from __future__ import annotations

import torch

import unickpt


def llama_config():
    import transformers

    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip


def llama(seed: int):
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config())
    model.eval()
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))


def logits(model) -> list[list[list[float]]]:
    with torch.no_grad():
        return model(tokens()).logits.tolist()


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def save_fsdp2(rank: int, ws: int, path: str, seed: int) -> None:
    unickpt.save(path, {"model": _fsdp2(llama(seed))}, framework="fsdp2")


def load_fsdp2_logits(rank: int, ws: int, path: str, seed: int) -> list[list[list[float]]]:
    model = _fsdp2(llama(seed))
    unickpt.load(path, {"model": model}, framework="fsdp2", strict=False)
    return logits(model)


def plain_logits(rank: int, ws: int, seed: int) -> list[list[list[float]]]:
    """The unsharded model's logits in a rank process (same thread count as the sharded ranks,
    so the float arithmetic is the same)."""
    return logits(llama(seed))


def load_bcp_into_fsdp2(rank: int, ws: int, path: str, seed: int) -> bool:
    """Load an imported ByteCheckpoint model into an FSDP2 model; compare full tensors with the
    seed's plain model (support.reference gathers the shards with torch only)."""
    from tests.support.reference import full_state

    model = _fsdp2(llama(seed + 1))
    unickpt.load(path, {"model": model}, framework="fsdp2", strict=False)
    got = full_state(model)
    want = {f"model.{k}": v for k, v in llama(seed).state_dict().items()}
    return all(torch.equal(got[k], want[k]) for k in want if k in got) and set(want) <= set(got)
