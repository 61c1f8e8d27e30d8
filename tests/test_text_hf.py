"""umt5:PATH / hf:PATH text encoders: tiny random models and tokenizers built offline and saved locally."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lerobot")

from flexpack.cli import main as cli_main  # noqa: E402
from flexpack.data import cache  # noqa: E402
from flexpack.data.encode import encode_dataset  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402
from flexpack.data.synthetic import make_synthetic_dataset  # noqa: E402
from flexpack.data.text import make_text_encoder  # noqa: E402
from hf_tiny import save_tiny_umt5, tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("text") / "ds", lengths=[9, 9, 13], seed=2)


def _reference(folder, text, max_len):
    from transformers import UMT5EncoderModel

    tok = tiny_tokenizer()(text, padding="max_length", max_length=max_len, truncation=True, return_tensors="pt")
    model = UMT5EncoderModel.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]).last_hidden_state[0]
    return out, int(tok["attention_mask"].sum())


def test_umt5_encodes_the_tasks_masked_and_cached_in_bf16(dataset, tmp_path):
    enc = save_tiny_umt5(tmp_path / "umt5")
    rep = encode_dataset(dataset, text_encoder=f"umt5:{enc}", text_max_len=12, text_batch_size=2, progress=False)
    tasks = EpisodeSource(dataset).tasks()
    assert sorted(rep.texts_written) == sorted(tasks)
    for task_index, task in tasks.items():
        path = cache.text_path(rep.latents_dir, task_index)
        head = cache.read_text_header(path)
        emb = cache.read_tensor(path, "text")
        ref, n = _reference(enc, task, 12)
        assert head.encoder == f"umt5:{enc}:12" and head.task == task and head.text_len == n
        assert head.shape == (12, 16) and 1 < n < 12
        assert torch.count_nonzero(emb[n:]) == 0  # padding rows zeroed
        assert torch.allclose(emb[:n], ref[:n], rtol=1e-2, atol=1e-2)  # bf16 storage
    # padding is masked: a longer pad gives the same embeddings at the real tokens
    long, n_long = make_text_encoder(f"umt5:{enc}", max_len=20).encode(tasks[0])
    short, n_short = make_text_encoder(f"umt5:{enc}", max_len=12).encode(tasks[0])
    assert n_long == n_short and torch.allclose(long[:n_short], short[:n_short], atol=1e-5)
    # rerunning skips everything; another max length re-encodes
    assert encode_dataset(dataset, text_encoder=f"umt5:{enc}", text_max_len=12, progress=False).texts_written == []
    assert len(encode_dataset(dataset, text_encoder=f"umt5:{enc}", text_max_len=10,
                              progress=False).texts_written) == len(tasks)


def test_batches_equal_single_texts_and_pipeline_layout(tmp_path):
    pipe = tmp_path / "Wan-Diffusers"
    save_tiny_umt5(pipe / "text_encoder", tokenizer=False)
    tiny_tokenizer().save_pretrained(pipe / "tokenizer")
    texts = ["pick the red cube", "open the drawer and push the blue block to the left", "lift &amp; stack   cup"]
    for path in (pipe, pipe / "text_encoder"):  # the pipeline folder, or its text_encoder/ with tokenizer/ beside
        enc = make_text_encoder(f"umt5:{path}", max_len=16)
        batched = enc.encode_batch(texts)
        for t, (emb, n) in zip(texts, batched):
            one, m = enc.encode(t)
            assert n == m and torch.allclose(emb, one, atol=1e-5)
    assert batched[2][1] == 5  # "lift & stack cup" + EOS: entities decoded, whitespace collapsed


def test_generic_hf_encoder(tmp_path, dataset):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=40, hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path / "bert")
    tiny_tokenizer().save_pretrained(tmp_path / "bert")
    emb, n = make_text_encoder(f"hf:{tmp_path / 'bert'}", max_len=8).encode("push the cube")
    assert emb.shape == (8, 24) and n == 4 and torch.count_nonzero(emb[n:]) == 0 and emb[:n].abs().sum() > 0
    # the CLI path, with device and batch options
    out = tmp_path / "lat"
    assert cli_main(["encode", "--dataset", str(dataset), "--latents-dir", str(out), "--no-progress",
                     "--text-encoder", f"hf:{tmp_path / 'bert'}", "--text-device", "cpu", "--text-batch-size", "1",
                     "--text-max-len", "8"]) == 0
    assert cache.read_text_header(cache.text_path(out, 0)).shape == (8, 24)


def test_encoder_without_tokenizer_is_one_line(tmp_path, dataset, capsys):
    enc = save_tiny_umt5(tmp_path / "bare", tokenizer=False)
    with pytest.raises(FileNotFoundError, match=r"bare: no tokenizer \(tokenizer.json"):
        make_text_encoder(f"umt5:{enc}")
    capsys.readouterr()  # drop save_pretrained's progress output
    assert cli_main(["encode", "--dataset", str(dataset), "--text-encoder", f"umt5:{enc}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexpack encode: error:") and "no tokenizer" in err and "\n" not in err
    shutil.rmtree(enc)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        make_text_encoder(f"umt5:{enc}")
