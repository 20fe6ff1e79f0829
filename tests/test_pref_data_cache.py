"""The preference cache (train/data/chat/pair_cache.py) and the front door (preference.py): pairs
tokenized once and reused, the same bytes from parquet, Arrow and JSONL and whatever the number of
workers, a tampered cache refused and rebuilt, a prompt that fills MAX_LENGTH as one line naming the
file and line, and preference_data's held-out split, summary and loaders through SFT's samplers."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from test_pref_data import tok  # noqa: F401 (the fixture)

from config import DataConfig
from data_tools import write_arrow_folder, write_jsonl, write_parquet
from train.core.errors import UsageError
from train.data.chat.formats import builtin_conversations
from train.data.chat.pair_cache import preference_cache
from train.data.chat.pair_encode import encode
from train.data.chat.pair_formats import builtin_pairs, load_pairs
from train.data.loader import make_loader, make_val_loader
from train.data.preference import preference_data
from train.models import KINDS


def pair_record(i: int) -> dict:
    prompt = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
    prompt += [{"role": "user", "content": f"Count to {i}."}]
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": " ".join(map(str, range(i + 1)))}],
            "rejected": [{"role": "assistant", "content": f"{i} is too many" * (1 + i % 3)}]}  # fmt: skip


RECORDS = [pair_record(i) for i in range(30)]


def cached(path, tok, cache, max_length=64, workers=1, skip=False, kind="causal"):  # noqa: F811
    lines: list[str] = []
    pairs, done = preference_cache(
        str(path), None, tok, max_length, skip, cache, workers, lines.append, KINDS[kind].layout
    )
    return pairs, done, lines


def every(pairs) -> list[dict]:
    return [pairs[i] for i in range(len(pairs))]


def test_pairs_are_tokenized_once_and_reused(tmp_path, tok):  # noqa: F811
    data = write_jsonl(tmp_path / "pairs.jsonl", RECORDS)
    first, done, lines = cached(data, tok, tmp_path / "c")
    assert done.startswith("preference cache: built") and any(
        "tokenizing 30 preference records" in x for x in lines
    )
    expected, _, _ = encode(load_pairs(data)[0], tok, 64)
    assert every(first) == expected and first.meta.format == "prompt" and first.meta.kind == "causal"
    assert first.sides.tolist() == [
        [len(e["prompt_ids"]), len(e["chosen_ids"]), len(e["rejected_ids"])] for e in expected
    ]
    again, done, lines = cached(data, tok, tmp_path / "c")
    assert done.startswith("preference cache: reused") and lines == [] and again.folder == first.folder
    assert every(first[25:]) == expected[25:]  # a slice is a view of the same files
    assert len(pickle.dumps(first[25:])) < 4096  # workers get file names and lengths, not the tokens
    t5, done, _ = cached(data, tok, tmp_path / "c", kind="seq2seq")  # the model kind is part of the key
    assert done.startswith("preference cache: built") and t5.folder != first.folder
    assert every(t5) == encode(load_pairs(data)[0], tok, 64, KINDS["seq2seq"].layout)[0]
    shorter, done, _ = cached(data, tok, tmp_path / "c", max_length=20)
    assert shorter.folder != first.folder and shorter.meta.n_truncated > 0 and shorter.meta.n_reply_cut > 0
    assert (shorter.sides[:, 0] + shorter.sides[:, 1:].max(axis=1)).max() <= 20


def test_parquet_arrow_and_workers_give_the_same_bytes(tmp_path, tok, monkeypatch):  # noqa: F811
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", RECORDS)
    want = every(cached(jsonl, tok, tmp_path / "c")[0])
    parquet = write_parquet(tmp_path / "pairs.parquet", RECORDS, row_group_rows=7)
    arrow = write_arrow_folder(
        tmp_path / "saved",
        [{"prompt": f"Count to {i}.", "chosen": str(i), "rejected": "no"} for i in range(12)],
    )
    assert every(cached(parquet, tok, tmp_path / "c")[0]) == want
    from_arrow = cached(arrow, tok, tmp_path / "c")[0]
    assert len(from_arrow) == 12 and from_arrow.meta.format == "prompt"
    monkeypatch.setattr("train.data.chat.cache.CHUNK_ROWS", 7)  # several chunks in flight
    one = cached(jsonl, tok, tmp_path / "one")[0]
    two = cached(jsonl, tok, tmp_path / "two", workers=2)[0]
    assert every(two) == want
    for name in ("ids.bin", "trained.bin", "lengths.bin"):
        assert (one.folder / name).read_bytes() == (two.folder / name).read_bytes(), name


def test_a_tampered_cache_is_refused_and_rebuilt(tmp_path, tok):  # noqa: F811
    data = write_jsonl(tmp_path / "pairs.jsonl", RECORDS)
    first, _, _ = cached(data, tok, tmp_path / "c")
    want = every(first)
    cached(data, tok, tmp_path / "c")  # verified once, remembered in checked.json
    for name, poison in (("ids.bin", b"\x00\x00"), ("trained.bin", b"\x01\x01")):
        path = first.folder / name
        raw = bytearray(path.read_bytes())
        raw[4:6] = poison if raw[4:6] != poison else b"\x02\x00"
        path.write_bytes(bytes(raw))
        again, done, lines = cached(data, tok, tmp_path / "c")
        assert any(f"was damaged ({name} does not hold the bytes" in x for x in lines), lines
        assert done.startswith("preference cache: built") and every(again) == want
    meta = json.loads((first.folder / "meta.json").read_text())
    (first.folder / "lengths.bin").write_bytes(b"")
    _, _, lines = cached(data, tok, tmp_path / "c")
    assert any("lengths.bin holds 0 bytes" in x for x in lines) and meta["n"] == 30


def test_a_prompt_that_fills_max_length_is_one_line_or_skipped(tmp_path, tok):  # noqa: F811
    long_system = {
        "prompt": [{"role": "system", "content": "Be brief. " * 40}, {"role": "user", "content": "Hi"}],
        "chosen": "Hello",
        "rejected": "Go away",
    }
    data = write_jsonl(tmp_path / "pairs.jsonl", [RECORDS[1], long_system, RECORDS[2]])
    with pytest.raises(UsageError) as err:
        cached(data, tok, tmp_path / "c", max_length=32)
    message = str(err.value)
    assert message.startswith(f"DATA_PATH: {data} line 2: has a prompt that alone fills MAX_LENGTH=32")
    assert "SKIP_BAD_RECORDS=1" in message and "\n" not in message
    assert not list((tmp_path / "c" / "pref").glob("*/meta.json"))  # nothing half-built left
    pairs, _, _ = cached(data, tok, tmp_path / "c", max_length=32, skip=True)
    assert len(pairs) == 2 and pairs.meta.n_skipped == 1 and "line 2" in pairs.meta.first_error


def data_config(tmp_path, data, **more) -> DataConfig:
    return DataConfig(data_path=str(data), cache_dir=str(tmp_path / "cache"), tokenize_workers=1, **more)


def front_door(d, tok, kind="causal", max_length=64):  # noqa: F811
    said, decided = [], {}
    data = preference_data(
        d,
        tok,
        layout=KINDS[kind].layout,
        max_length=max_length,
        device=torch.device("cpu"),
        precision="fp32",
        eval_batches=1,
        set_attention=lambda kind: None,
        say=said.append,
        decide=lambda name, value, why: decided.update({name: value}),
    )
    return data, said, decided


def test_front_door_holds_out_pairs_and_batches_them_through_the_samplers(tmp_path, tok):  # noqa: F811
    data_path = write_jsonl(tmp_path / "pairs.jsonl", RECORDS)
    d = data_config(tmp_path, data_path, val_fraction=0.1, length_grouping=True, packing=False)  # padded rows
    data, said, decided = front_door(d, tok)
    assert len(data.dataset) + len(data.val_dataset) == 30 and len(data.val_dataset) == 3
    assert (
        data.summary["n_pairs"] == 30
        and data.summary["n_val_pairs"] == 3
        and data.summary["data_format"] == "prompt"
    )
    assert decided["validation"] == "3 pairs" and decided["template"] == "builtin"
    assert any("preference data:" in line and "30 pairs" in line for line in said)
    assert data.val_dataset[0] == encode(load_pairs(data_path)[0], tok, 64)[0][27]  # the last 10 %
    loader, sampler = make_loader(
        data.dataset, d, 4, seed=0, device=torch.device("cpu"), collate_fn=data.collate
    )
    batch = next(iter(loader))
    assert batch["input_ids"].shape[0] == 8 and batch["n_pairs"] == 4  # 4 pairs -> 8 rows
    assert type(sampler).__name__ == "GroupedSampler"
    val = next(iter(make_val_loader(data.val_dataset, 2, torch.device("cpu"), data.val_collate)))
    assert val["labels"].shape[0] == 4
    budget = data_config(tmp_path, data_path, val_fraction=0.0, token_budget=400)
    loader, sampler = make_loader(
        front_door(budget, tok)[0].dataset,
        budget,
        4,
        seed=0,
        device=torch.device("cpu"),
        collate_fn=data.collate,
    )
    for batch in loader:  # a budget counts the padded rows: 2 per pair, prompt + longer reply wide
        assert batch["n_padded_tokens"] <= 400 or batch["n_pairs"] == 1


def test_front_door_val_path_and_one_line_refusals(tmp_path, tok):  # noqa: F811
    data_path = write_jsonl(tmp_path / "pairs.jsonl", RECORDS)
    val_path = write_jsonl(tmp_path / "val.jsonl", RECORDS[:5])
    data, _, decided = front_door(data_config(tmp_path, data_path, val_path=str(val_path)), tok)
    assert len(data.dataset) == 30 and len(data.val_dataset) == 5 and decided["validation"] == "5 pairs"
    bad_val = tmp_path / "bad_val.jsonl"
    bad_val.write_text(json.dumps({"prompt": "Hi", "chosen": "Same", "rejected": "Same"}) + "\n")
    with pytest.raises(UsageError, match=r"^VAL_PATH: .*bad_val.jsonl line 1: chosen and rejected are the "
                                         r"same"):
        front_door(data_config(tmp_path, data_path, val_path=str(bad_val)), tok)
    with pytest.raises(UsageError, match="^LOSS_ON=all: preference training scores the replies only"):
        front_door(data_config(tmp_path, data_path, loss_on="all"), tok)
    with pytest.raises(UsageError, match="^PACKING=1: an encoder-decoder"):
        front_door(data_config(tmp_path, data_path, packing=True), tok, kind="seq2seq")
    # DATA_PATH empty is the built-in pairs, not an error
    with pytest.raises(UsageError, match="^LOSS_ON=all"):
        front_door(DataConfig(cache_dir=str(tmp_path / "cache"), loss_on="all"), tok)


def test_the_built_in_pairs_prefer_each_prompts_own_reply_and_are_cached(tmp_path, tok):  # noqa: F811
    """DATA_PATH empty: SFT's built-in conversations, each prompt's own body chosen over another
    function's; deterministic, never chosen == rejected, cached under the pairs themselves."""
    conversations = builtin_conversations(60)
    pairs = builtin_pairs(60)
    assert pairs == builtin_pairs(60) and 50 <= len(pairs) <= 60
    replies = {c[0]["content"]: c[1]["content"] for c in conversations}
    for pair in pairs:
        prompt = pair["prompt"][0]["content"]
        assert pair["chosen"][0]["content"] == replies[prompt] != pair["rejected"][0]["content"]
        assert pair["rejected"][0]["content"] in replies.values()
    lines: list[str] = []
    cached_pairs, done = preference_cache(None, pairs, tok, 64, False, tmp_path / "c", 1, lines.append)
    assert done.startswith("preference cache: built") and len(cached_pairs) == len(pairs)
    assert every(cached_pairs) == encode(pairs, tok, 64)[0]
    again, done = preference_cache(None, pairs[:-1], tok, 64, False, tmp_path / "c", 1, lines.append)
    assert done.startswith("preference cache: built") and len(again) == len(pairs) - 1  # keyed by the pairs
