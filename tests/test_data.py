"""Data pipeline: sources and formats, mixture weights, chat templating and assistant masks, packing, batches.

References not written here: transformers' own chat tokenization and its `{% generation %}` assistant mask,
the tokenizer's decoding, a plain-Python greedy packer, and the model run on each document alone.
"""

import collections
import dataclasses
import gzip
import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import swiftkv_jax as sk
from swiftkv_jax.data import Batches, DataConfig, DataError, DataSource, build_dataset, load_tokenizer, toy
from swiftkv_jax.data import packing
from swiftkv_jax.data.chat import FEATURES as DOC_FEATURES
from swiftkv_jax.data.chat import encode
from swiftkv_jax.data.sources import load_mixture

datasets.disable_progress_bars()

EXAMPLES = toy.synthetic_chat_examples(80, seed=0)
# The toy template with the assistant's part marked for transformers' own return_assistant_tokens_mask.
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return toy.train_chat_tokenizer([m["content"] for e in EXAMPLES for m in e["messages"]], vocab_size=512)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def mixture(tmp_path, *sources, seed=0):
    return load_mixture(sources, seed=seed, cache_dir=str(tmp_path / "cache"))


# --- sources and formats -------------------------------------------------------------------------------------


def test_formats_from_local_files(tmp_path):
    chats = EXAMPLES[:5]
    pairs = [{"question": f"q{i}?", "answer": f"a{i}.", "id": i} for i in range(4)]
    texts = [f"document number {i}" for i in range(3)]
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))  # a JSON array of records
    pq.write_table(pa.table({"body": texts}), tmp_path / "texts.parquet")
    (tmp_path / "lines.txt").write_text("first line\n\nsecond line\n")  # the blank line is no document
    ds = mixture(tmp_path, DataSource(write_jsonl(tmp_path / "chats.jsonl", chats)),
                 DataSource(str(tmp_path / "pairs.json"), prompt_field="question", response_field="answer"),
                 DataSource(str(tmp_path / "texts.parquet"), format="text", text_field="body"),
                 DataSource(str(tmp_path / "lines.txt")))
    assert ds.column_names == ["messages", "text"]
    assert ds["messages"][:5] == [e["messages"] for e in chats] and ds["text"][:5] == [None] * 5
    assert ds["messages"][5:9] == [[{"role": "user", "content": p["question"]},
                                    {"role": "assistant", "content": p["answer"]}] for p in pairs]
    assert ds["messages"][9:] == [[]] * 5
    assert ds["text"][9:] == texts + ["first line", "second line"]


def test_sharegpt_conversations_read_as_chat(tmp_path):
    """OpenHermes-2.5's layout: `conversations` of {from: system|human|gpt, value}."""
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"},
                               {"from": "gpt", "value": "4"}], "source": "x"}]
    ds = mixture(tmp_path, DataSource(write_jsonl(tmp_path / "hermes.jsonl", rows), messages_field="conversations"))
    assert ds["messages"] == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                               {"role": "assistant", "content": "4"}]]


def test_lmsys_chat_conversations_read_as_chat(tmp_path):
    """lmsys/lmsys-chat-1m's layout (the source the published ArcticTraining recipes use, documented in configs/):
    `conversation` of {content, role}, beside metadata columns."""
    rows = [{"conversation_id": "a", "model": "vicuna-13b", "turn": 1, "language": "English", "redacted": False,
             "conversation": [{"content": "2+2?", "role": "user"}, {"content": "4", "role": "assistant"}]}]
    src = DataSource(write_jsonl(tmp_path / "lmsys.jsonl", rows), format="chat", messages_field="conversation")
    assert mixture(tmp_path, src)["messages"] == [[{"role": "user", "content": "2+2?"},
                                                   {"role": "assistant", "content": "4"}]]


def test_messages_whose_keys_differ_read_as_chat(tmp_path):
    """datasets stores messages whose dicts differ in keys (a ShareGPT `weight`, an OpenAI `name` on some turns)
    as Json rather than a struct: read message by message."""
    sharegpt = [{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y", "weight": 1.0}]}]
    openai = [{"messages": [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "yo"}]}]
    ds = mixture(tmp_path, DataSource(write_jsonl(tmp_path / "w.jsonl", sharegpt), messages_field="conversations"),
                 DataSource(write_jsonl(tmp_path / "n.jsonl", openai)))
    assert ds["messages"] == [[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                              [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]


def test_turns_that_would_train_an_empty_reply_are_refused(tmp_path):
    """An assistant turn of tool calls alone, or a null response, would be trained as an empty reply."""
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    tools = [{"messages": [{"role": "user", "content": "Weather?", "tool_calls": None},
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "content": "18C", "tool_calls": None},
                           {"role": "assistant", "content": "It is 18C.", "tool_calls": None}]}]
    with pytest.raises(DataError, match="role 'assistant' holds tool_calls and no content .*drop or filter"):
        mixture(tmp_path, DataSource(write_jsonl(tmp_path / "tools.jsonl", tools)))
    pairs = [{"prompt": "hi", "response": None}, {"prompt": "a", "response": "b"}]
    with pytest.raises(DataError, match="an example whose 'prompt' or 'response' is not a string .*drop it"):
        mixture(tmp_path, DataSource(write_jsonl(tmp_path / "pairs.jsonl", pairs)))


def test_globs_directories_and_max_examples(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": f"a{i}"} for i in range(3)])
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": f"b{i}"} for i in range(4)])
    assert sorted(mixture(tmp_path, DataSource(str(tmp_path / "d" / "*.jsonl")))["text"]) == sorted(
        [f"a{i}" for i in range(3)] + [f"b{i}" for i in range(4)])
    assert len(mixture(tmp_path, DataSource(str(tmp_path / "d")))) == 7
    assert mixture(tmp_path, DataSource(str(tmp_path / "d" / "b.jsonl"), max_examples=2))["text"] == ["b0", "b1"]


def test_mixture_weights_count_examples_and_are_seeded(tmp_path):
    def source(name, n, weight):
        return DataSource(write_jsonl(tmp_path / f"{name}.jsonl", [{"text": f"{name}{i}"} for i in range(n)]),
                          weight=weight)

    sources = source("quarter", 20, 0.25), source("twice", 10, 2), source("once_and_half", 10, 1.5)
    counts = collections.Counter(mixture(tmp_path, *sources)["text"])
    by_source = {name: {k: v for k, v in counts.items() if k.startswith(name)}
                 for name in ("quarter", "twice", "once_and_half")}
    assert sorted(by_source["quarter"].values()) == [1] * 5
    assert by_source["twice"] == {f"twice{i}": 2 for i in range(10)}
    assert sorted(by_source["once_and_half"].values()) == [1] * 5 + [2] * 5
    assert mixture(tmp_path, *sources)["text"] == mixture(tmp_path, *sources)["text"]
    assert mixture(tmp_path, *sources)["text"] != mixture(tmp_path, *sources, seed=1)["text"]


# --- chat templating and the assistant mask ------------------------------------------------------------------


def runs(mask):
    """[start, end) of every run of ones."""
    edges = np.diff(np.r_[0, mask, 0])
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def test_assistant_mask_is_the_assistant_contents(tokenizer):
    multi_turn = [e["messages"] for e in EXAMPLES if sum(m["role"] == "assistant" for m in e["messages"]) > 1]
    assert len(multi_turn) >= 5
    for messages in multi_turn + [e["messages"] for e in EXAMPLES[:10]]:
        ids, mask = encode(tokenizer, messages, None)
        assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert ids.count(tokenizer.bos_token_id) == 1
        decoded = [tokenizer.decode(ids[s:e]) for s, e in runs(np.asarray(mask))]
        assert decoded == [m["content"] + "<|eot_id|>" for m in messages if m["role"] == "assistant"]
        hf = tokenizer.apply_chat_template(messages, chat_template=GENERATION_TEMPLATE, return_dict=True,
                                           return_assistant_tokens_mask=True)
        assert hf["input_ids"] == ids and hf["assistant_masks"] == list(mask)


@pytest.mark.parametrize("greeting", ["Hi! Ask me a sum.", "x marks the spot."])  # "x": the placeholder's letter
def test_an_opening_assistant_turn_is_trained_as_any_reply(tokenizer, greeting):
    """A conversation that opens with the assistant (a greeting) is masked as transformers' `{% generation %}` mask
    (TRL's assistant_only_loss) marks it: every assistant turn, the first one too."""
    messages = [{"role": "assistant", "content": greeting}, *EXAMPLES[1]["messages"]]
    ids, mask = encode(tokenizer, messages, None)
    hf = tokenizer.apply_chat_template(messages, chat_template=GENERATION_TEMPLATE, return_dict=True,
                                       return_assistant_tokens_mask=True)
    assert hf["input_ids"] == ids and hf["assistant_masks"] == list(mask)
    assert tokenizer.decode(ids[slice(*runs(np.asarray(mask))[0])]) == greeting + "<|eot_id|>"


def test_text_documents_get_bos_and_eos(tokenizer):
    ids, mask = encode(tokenizer, [], "What is 2 + 2?")
    assert ids == tokenizer("What is 2 + 2?")["input_ids"] + [tokenizer.eos_token_id]
    assert ids[0] == tokenizer.bos_token_id and list(mask) == [1] * len(ids)


def test_text_of_a_rendered_conversation_keeps_one_bos_and_eos(tokenizer):
    """A text column of conversations already through the chat template: the ids the chat path gives, as
    transformers' apply_chat_template (and serving) do, not a second BOS before and a second EOT after."""
    messages = EXAMPLES[0]["messages"]
    ids, _ = encode(tokenizer, [], tokenizer.apply_chat_template(messages, tokenize=False))
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[-2:] != [tokenizer.eos_token_id] * 2


def test_tokenizer_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for e in EXAMPLES[:5]:
        assert encode(loaded, e["messages"], None) == encode(tokenizer, e["messages"], None)
        assert loaded.decode(encode(loaded, [], e["messages"][-1]["content"])[0]) == (
            "<|begin_of_text|>" + e["messages"][-1]["content"] + "<|eot_id|>")


def test_templates_that_rewrite_earlier_turns_need_loss_mask_all(tokenizer):
    tokenizer = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, bos_token=tokenizer.bos_token,
                                    eos_token=tokenizer.eos_token,
                                    chat_template="{{ messages | length }}" + toy.CHAT_TEMPLATE)
    with pytest.raises(DataError, match="not render turn 1 .assistant. as a continuation.*loss_mask: all"):
        encode(tokenizer, EXAMPLES[1]["messages"], None)
    ids, mask = encode(tokenizer, EXAMPLES[1]["messages"], None, assistant_mask=False)
    assert tokenizer.decode(ids).startswith("2<|begin_of_text|>") and list(mask) == [1] * len(ids)


def test_tokenizer_errors(tokenizer, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no tokenizer in .*empty.*save_pretrained"):
        load_tokenizer(str(tmp_path / "empty"))
    plain = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, bos_token=tokenizer.bos_token)
    with pytest.raises(DataError, match="no chat template.*format: text"):
        encode(plain, EXAMPLES[0]["messages"], None)


def test_a_template_that_refuses_a_conversation_names_its_roles(tokenizer):
    """Llama 2's template raises on a system turn (raise_exception): a DataError with the roles and the fix."""
    refuses_system = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                      "{% endif %}" + toy.CHAT_TEMPLATE)
    strict = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, bos_token=tokenizer.bos_token,
                                 eos_token=tokenizer.eos_token, chat_template=refuses_system)
    messages = [{"role": "system", "content": "Be brief."}, *EXAMPLES[0]["messages"]]
    roles = ", ".join(m["role"] for m in messages)
    with pytest.raises(DataError, match=rf"refused a conversation \(roles: {roles}\): System role not supported\. "
                                        rf"Drop or merge the turns it refuses"):
        encode(strict, messages, None)
    assert encode(strict, EXAMPLES[0]["messages"], None) == encode(tokenizer, EXAMPLES[0]["messages"], None)


# --- packing -------------------------------------------------------------------------------------------------


def reference_pack(docs, flags, seq_len, loss_mask, pad):
    """Greedy packing written plainly: pieces of <= seq_len, a new row when the next piece does not fit."""
    pieces = [(d[i:i + seq_len], f[i:i + seq_len]) for d, f in zip(docs, flags) for i in range(0, len(d), seq_len)]
    rows = [[]]
    for piece in pieces:
        if sum(len(p) for p, _ in rows[-1]) + len(piece[0]) > seq_len:
            rows.append([])
        rows[-1].append(piece)
    out = {k: np.zeros((len(rows), seq_len), np.int64) for k in packing.features(seq_len)}
    out["tokens"][:] = pad
    for r, row in enumerate(rows):
        t = 0
        for segment, (ids, flag) in enumerate(row, start=1):
            for j, token in enumerate(ids):
                out["tokens"][r, t], out["positions"][r, t], out["segment_ids"][r, t] = token, j, segment
                out["loss_mask"][r, t] = 1 if loss_mask == "all" else int(j + 1 < len(ids) and flag[j + 1])
                t += 1
    return out


def doc_dataset(lengths, seed=0):
    rng = np.random.default_rng(seed)
    docs = [list(range(1000 * d + 1, 1000 * d + 1 + n)) for d, n in enumerate(lengths)]
    flags = [list(rng.integers(0, 2, n)) for n in lengths]
    return docs, flags, datasets.Dataset.from_dict({"input_ids": docs, "assistant": flags, "length": lengths},
                                                   features=DOC_FEATURES)


def as_arrays(ds):
    return {k: np.asarray(v) for k, v in ds.with_format("numpy")[:].items()}


def test_packing_invariants():
    lengths = [5, 7, 3, 20, 9, 16, 1]  # seq_len 16: [5 7 3 pad] [16] [4 9 pad] [16] [1 pad]
    docs, flags, ds = doc_dataset(lengths)
    out = as_arrays(packing.pack(ds, 16, "assistant", pad_id=-1))
    assert [sorted(set(row[row > 0].tolist())) for row in out["segment_ids"]] == [[1, 2, 3], [1], [1, 2], [1], [1]]
    assert (out["segment_ids"] == 0).sum(axis=1).tolist() == [1, 0, 3, 0, 15]
    assert ((out["segment_ids"] == 0) == (out["tokens"] == -1)).all()
    np.testing.assert_array_equal(out["positions"][0], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0])
    # the long document's pieces, each with positions from 0, give back the document
    np.testing.assert_array_equal(np.r_[out["tokens"][1], out["tokens"][2, :4]], docs[3])
    np.testing.assert_array_equal(out["positions"][2, :4], np.arange(4))
    # loss at t when t+1 is the same document's assistant token; never at a document's last token
    seg = out["segment_ids"]
    last = (seg != np.c_[seg[:, 1:], np.zeros(len(seg))]) & (seg > 0)
    assert not (out["loss_mask"] * last).any()
    assert out["loss_mask"][0, 0] == flags[0][1] and out["loss_mask"][0, 5:12].tolist() == flags[1][1:] + [0]
    for mode in ("all", "assistant"):
        reference = reference_pack(docs, flags, 16, mode, pad=-1)
        got = as_arrays(packing.pack(ds, 16, mode, pad_id=-1))
        for k in reference:
            np.testing.assert_array_equal(got[k], reference[k], err_msg=f"{mode} {k}")
            assert got[k].shape == (5, 16)


def test_pretraining_trains_on_exactly_the_assistant_tokens():
    """The packer's assistant mask and the pretraining objective's targets (`next_token_targets`) together score
    each assistant token, predicted from the token before it in its piece, and nothing else."""
    from swiftkv_jax.distill.step import next_token_targets

    docs, flags, ds = doc_dataset([5, 7, 3, 20, 9, 16, 1])
    targets, weights = map(np.asarray, next_token_targets(as_arrays(packing.pack(ds, 16, "assistant", pad_id=-1))))
    pieces = [(d[i:i + 16], f[i:i + 16]) for d, f in zip(docs, flags) for i in range(0, len(d), 16)]
    want = sorted(t for ids, flag in pieces for j, t in enumerate(ids) if j > 0 and flag[j])
    assert len(want) > 10 and sorted(targets[weights > 0].tolist()) == want  # every document's tokens differ


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the workers only pack numpy; they never touch JAX
def test_packing_is_the_same_for_any_chunking_and_num_proc(monkeypatch):
    lengths = list(np.random.default_rng(1).integers(1, 40, 120))
    docs, flags, ds = doc_dataset(lengths, seed=1)
    reference = reference_pack(docs, flags, 32, "assistant", pad=0)
    monkeypatch.setattr(packing, "ROWS_PER_CHUNK", 3)
    for num_proc in (None, 2):
        got = as_arrays(packing.pack(ds, 32, "assistant", num_proc=num_proc))
        for k in reference:
            np.testing.assert_array_equal(got[k], reference[k], err_msg=f"num_proc={num_proc} {k}")


def test_packed_rows_give_each_document_its_own_logits(tokenizer, tmp_path):
    config = sk.ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = sk.init(config, 0)
    src = DataSource(write_jsonl(tmp_path / "c.jsonl", EXAMPLES[:12]))
    ds = build_dataset(DataConfig(sources=(src,), seq_len=128, cache_dir=str(tmp_path / "cache")), tokenizer)[:]
    busiest = int(np.argmax(ds["segment_ids"].max(axis=1)))
    row = {k: v[busiest:busiest + 1] for k, v in ds.items()}
    assert row["segment_ids"].max() >= 3
    packed = np.asarray(sk.logits(model, row["tokens"], positions=row["positions"], segment_ids=row["segment_ids"]))
    for segment in set(row["segment_ids"][0].tolist()) - {0}:
        where = row["segment_ids"][0] == segment
        alone = np.asarray(sk.logits(model, row["tokens"][:, where]))
        np.testing.assert_allclose(packed[:, where], alone, atol=1e-5, rtol=1e-5)


# --- the training set and its batches ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", EXAMPLES)


def build(tokenizer, path, tmp_path, seed=0, **kw):
    cfg = DataConfig(sources=(DataSource(path),), seq_len=64, loss_mask="assistant", seed=seed,
                     cache_dir=str(tmp_path / f"cache-{seed}"), **kw)
    return build_dataset(cfg, tokenizer)


def documents(ds):
    """The (piece) documents of a packed dataset, as token tuples."""
    out = []
    for tokens, seg in zip(ds["tokens"], ds["segment_ids"]):
        out += [tuple(tokens[seg == s]) for s in range(1, seg.max() + 1)]
    return out


def test_document_shuffle_is_seeded(tokenizer, chat_file, tmp_path):
    a, again, b = (build(tokenizer, chat_file, tmp_path / name, seed=seed)
                   for name, seed in (("a", 0), ("again", 0), ("b", 1)))
    np.testing.assert_array_equal(a["tokens"], again["tokens"])
    assert documents(a) != documents(b)
    # the same documents either way, every example once (conversations above 64 tokens in pieces)
    assert collections.Counter(documents(a)) == collections.Counter(documents(b))
    assert sum(doc[0] == tokenizer.bos_token_id for doc in documents(a)) == len(EXAMPLES)


def test_long_documents_drop_leaves_out_what_split_cuts_in_pieces(tokenizer, chat_file, tmp_path):
    """long_documents: drop keeps exactly the conversations of at most seq_len tokens, each whole (the published
    recipe's filter, ArcticTraining arctic_training/data/sft_factory.py `filter_dataset_length`); split (the
    default) packs the longer ones too, in seq_len pieces."""
    whole = [tuple(encode(tokenizer, e["messages"], None, assistant_mask=True)[0]) for e in EXAMPLES]
    short = collections.Counter(d for d in whole if len(d) <= 64)
    assert 0 < sum(short.values()) < len(whole)  # the toy data has both kinds at seq_len 64
    dropped = documents(build(tokenizer, chat_file, tmp_path / "drop", long_documents="drop"))
    assert collections.Counter(dropped) == short
    split = documents(build(tokenizer, chat_file, tmp_path / "split"))
    assert short < collections.Counter(split) and len(split) > len(whole)
    with pytest.raises(DataError, match="every document is longer than seq_len=2 tokens, so long_documents: drop"):
        build_dataset(DataConfig(sources=(DataSource(chat_file),), seq_len=2, long_documents="drop",
                                 cache_dir=str(tmp_path / "none")), tokenizer)


@pytest.fixture(scope="module")
def packed(tokenizer, chat_file, tmp_path_factory):
    return build(tokenizer, chat_file, tmp_path_factory.mktemp("packed"))


def test_batches_resume_exactly(packed):
    batches = Batches(packed, 5, seed=3)
    assert batches.steps_per_epoch == len(packed) // 5 and len(packed) % 5 != 0
    uninterrupted = [next(batches) for _ in range(2 * batches.steps_per_epoch + 3)]
    assert batches.position == len(uninterrupted) and batches.epoch == 2
    first = {k: v.dtype for k, v in uninterrupted[0].items()}
    assert first == {"tokens": np.int32, "positions": np.int32, "segment_ids": np.int32, "loss_mask": np.int8}
    assert uninterrupted[0]["tokens"].shape == (5, 64)
    for p in (1, batches.steps_per_epoch, batches.steps_per_epoch + 2):
        resumed = Batches(packed, 5, seed=3, start=p)
        for expected in uninterrupted[p:]:
            for k, v in next(resumed).items():
                np.testing.assert_array_equal(v, expected[k])
    # an epoch reads distinct rows of the dataset; the next epoch reads them in another order
    epoch = [Batches(packed, 5, seed=3).indices(p) for p in range(batches.steps_per_epoch)]
    assert len(set(np.concatenate(epoch).tolist())) == 5 * batches.steps_per_epoch
    assert not np.array_equal(epoch[0], Batches(packed, 5, seed=3).indices(batches.steps_per_epoch))
    np.testing.assert_array_equal(uninterrupted[0]["tokens"], packed["tokens"][epoch[0]])


def test_processes_together_read_the_one_process_batch(packed):
    whole = Batches(packed, 6, seed=0, start=5)
    shares = [Batches(packed, 6, seed=0, rows=rows, start=5) for rows in ([0, 2, 4], [1, 3, 5])]
    for _ in range(3):
        expected, parts = next(whole), [next(s) for s in shares]
        for k in expected:
            np.testing.assert_array_equal(expected[k][0::2], parts[0][k])
            np.testing.assert_array_equal(expected[k][1::2], parts[1][k])
    assert next(Batches(packed, 6, seed=0, rows=[]))["tokens"].shape == (0, 64)


def test_bad_settings(packed, tokenizer, tmp_path):
    with pytest.raises(DataError, match=f"has {len(packed)} rows, fewer than one global batch of {len(packed) + 1}"):
        Batches(packed, len(packed) + 1, seed=0)
    with pytest.raises(DataError, match=r"rows must lie in \[0, 4\), got \[1, 4\]"):
        Batches(packed, 4, seed=0, rows=[1, 4])
    src = DataSource(write_jsonl(tmp_path / "c.jsonl", EXAMPLES[:3]))
    with pytest.raises(DataError, match="unknown loss_mask 'assistants'; use one of all, assistant"):
        build_dataset(DataConfig(sources=(src,), loss_mask="assistants"), tokenizer)
    with pytest.raises(DataError, match="unknown long_documents 'truncate'; use one of split, drop"):
        build_dataset(DataConfig(sources=(src,), long_documents="truncate"), tokenizer)
    with pytest.raises(DataError, match="seq_len must be an integer >= 2, got 0"):
        build_dataset(DataConfig(sources=(src,), seq_len=0, cache_dir=str(tmp_path / "cache")), tokenizer)
    (tmp_path / "afile").write_text("kept")
    with pytest.raises(DataError, match=f"data.cache_dir='{tmp_path / 'afile'}' is a file, not a directory"):
        build_dataset(DataConfig(sources=(src,), cache_dir=str(tmp_path / "afile")), tokenizer)
    assert (tmp_path / "afile").read_text() == "kept"


# --- errors that say what is wrong and what to do ------------------------------------------------------------


@pytest.mark.parametrize("case,match", [
    ("missing", "no such file or directory"),
    ("extension", r"unknown or mixed file extension\(s\) \['.csv'\]"),
    ("format", "unknown format 'sharegpt'; use one of auto, chat, prompt_response, text"),
    ("field", r"format 'prompt_response' needs field\(s\) \['prompt', 'response'\]; fields present: \['messages'\]"),
    ("undetectable", r"cannot tell the format.*fields present: \['body', 'id'\]"),
    ("messages", r"field 'conversations' must be a list of {role, content} \(or ShareGPT {from, value}\) messages"),
    ("offline", "hub dataset unreachable.*offline.*hf download.*local"),
    ("empty", "has no examples: its file.s. are empty"),
    ("blank", "every example is empty"),
    ("weight", "weight must be a finite number > 0"),
    ("nan", "weight must be a finite number > 0"),
    ("small", "weight 0.01 of 3 examples keeps none of them; raise the weight"),
    ("none", "no data sources"),
    ("chat field", r"format 'chat' needs field\(s\) \['messages'\]; fields present: \['conv'\]\. Name the right "
                   r"field in the source with messages_field \(e\.g\. \{path: \.\.\., format: chat, "
                   r"messages_field: conv\}\)"),
    ("split", r"split 'test', but local files are one split, 'train' \(as datasets.load_dataset reads data_files\)"),
    ("text row", r"example 2 has no list of messages in 'messages' \(got None; its fields: \['text'\]\): drop it, or "
                 r"give examples of another format a source of their own"),
    ("no turns", "every example is empty"),
    ("role", r"example 1: unknown role 'bot'; chat templates know the roles system, user, assistant, tool .*rename"),
    ("truncated", r"cannot read the file\(s\) \(a compressed file is truncated: .*\); re-download or re-compress it"),
])
def test_bad_data_errors(tmp_path, case, match):
    chats = write_jsonl(tmp_path / "chats.jsonl", EXAMPLES[:3])
    (tmp_path / "t.csv").write_text("a,b\n1,2\n")
    sources = {
        "missing": DataSource("data/missing.jsonl"),
        "extension": DataSource(str(tmp_path / "t.csv")),
        "format": DataSource(chats, format="sharegpt"),
        "field": DataSource(chats, format="prompt_response"),
        "undetectable": DataSource(write_jsonl(tmp_path / "odd.jsonl", [{"body": "x", "id": 1}])),
        "messages": DataSource(write_jsonl(tmp_path / "sharegpt.jsonl", [
            {"conversations": [{"speaker": "human", "text": "hi"}]}]), messages_field="conversations"),
        "offline": DataSource("someone/some_chat_dataset"),
        "empty": DataSource(write_jsonl(tmp_path / "empty.jsonl", [])),
        "blank": DataSource(write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}])),
        "weight": DataSource(chats, weight=0),
        "nan": DataSource(chats, weight=float("nan")),
        "small": DataSource(chats, weight=0.01),
        "chat field": DataSource(write_jsonl(tmp_path / "conv.jsonl", [{"conv": EXAMPLES[0]["messages"]}]),
                                 format="chat"),
        "split": DataSource(chats, split="test"),
        "text row": DataSource(write_jsonl(tmp_path / "mixed.jsonl", [*EXAMPLES[:2], {"text": "a plain document"}])),
        "no turns": DataSource(write_jsonl(tmp_path / "no_turns.jsonl", [{"messages": []}] * 3)),
        "role": DataSource(write_jsonl(tmp_path / "bot.jsonl", [EXAMPLES[0], {"messages": [
            {"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}])),
        "truncated": DataSource(str(tmp_path / "cut.jsonl.gz")),
    }
    packed = gzip.compress(json.dumps(EXAMPLES[0]).encode() + b"\n")
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[:len(packed) // 2])  # a download cut short
    with pytest.raises(DataError, match=match):
        mixture(tmp_path, *([sources[case]] if case in sources else []))


def test_a_split_of_local_files_is_a_slice_of_train(tmp_path):
    """As datasets.load_dataset(..., data_files=...) reads a file: one split, train, whose slices work."""
    chats = write_jsonl(tmp_path / "chats.jsonl", EXAMPLES[:40])
    part = mixture(tmp_path, DataSource(chats, split="train[:25%]"))
    assert len(part) == 10 and part[0]["messages"][0]["content"] == EXAMPLES[0]["messages"][0]["content"]


def test_no_trained_token_is_an_error(tokenizer, tmp_path):
    """loss_mask: assistant on chats without assistant turns would train on a loss of exactly 0 at every step."""
    users = write_jsonl(tmp_path / "users.jsonl", [{"messages": e["messages"][:1]} for e in EXAMPLES[:20]])
    config = DataConfig(sources=(DataSource(users),), seq_len=64, loss_mask="assistant",
                        cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=f"data.loss_mask: assistant leaves no token to train on in the data of "
                                        f"'{users}'.*data.loss_mask: all"):
        build_dataset(config, tokenizer)
    assert build_dataset(dataclasses.replace(config, loss_mask="all"), tokenizer)[:]["loss_mask"].sum() > 0


def test_a_missing_tokenizer_directory_is_named_as_missing(tmp_path):
    with pytest.raises(DataError, match=f"the tokenizer directory '{tmp_path / 'nothere'}' does not exist: check"):
        load_tokenizer(str(tmp_path / "nothere"))


def test_the_tokenized_cache_follows_the_tokenizer_not_its_folder(tokenizer, tmp_path):
    """A copy of the teacher's tokenizer in another folder finds the tokens cached by the first (datasets hashed the
    object, its folder included: a moved teacher re-tokenized everything); another chat template does not."""
    src = DataSource(write_jsonl(tmp_path / "c.jsonl", EXAMPLES[:12]))
    config = DataConfig(sources=(src,), seq_len=64, cache_dir=str(tmp_path / "cache"))
    files = {}
    for name in ("a", "b"):
        tokenizer.save_pretrained(tmp_path / name)
        files[name] = build_dataset(config, load_tokenizer(str(tmp_path / name))).cache_files
    assert files["a"] == files["b"]
    other = load_tokenizer(str(tmp_path / "a"))
    other.chat_template = other.chat_template.replace("<|eot_id|>", "<|eot_id|>\n")
    assert build_dataset(config, other).cache_files != files["a"]
