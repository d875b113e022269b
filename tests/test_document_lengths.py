"""The document-length histogram (minigpt/benchmarks/document_lengths.py): segments of the ids, the causal work the
mask keeps, and the command on local text with short documents."""
import json

import pytest
import torch

from minigpt.benchmarks.document_lengths import main, segment_lengths, summarize


def test_segments_follow_the_ids_row_by_row():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    assert segment_lengths(ids) == [3, 2, 3, 8]


def test_summary_bins_median_and_causal_work():
    stats = summarize([3, 2, 3, 8], seq_len=8)
    assert stats["windows"] == 2 and stats["segments"] == 4
    assert [(b["from"], b["segments"], b["tokens"]) for b in stats["bins"]] == [(2, 3, 8), (8, 1, 8)]
    assert stats["token_weighted_median"] == 3  # 8 of the 16 tokens lie in segments of <= 3
    assert [b["to"] for b in summarize([3000, 1500], seq_len=3000)["bins"]] == [2048, 3000]  # whole windows apart
    with pytest.raises(ValueError, match="no document lengths"):
        summarize([], seq_len=8)
    # kept pairs: (6 + 3 + 6) + 36 = 51 of 2 * 36 causal pairs
    assert stats["causal_work"] == pytest.approx(51 / 72)


def test_command_writes_the_histogram_for_short_documents(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = torch.Generator().manual_seed(0)
    for i in range(200):  # documents of 10-30 random short words: several in every 128-token window
        n = 10 + i % 21
        letters = torch.randint(0, 26, (n, 3), generator=rng).tolist()
        (corpus / f"d{i:03d}.txt").write_text(" ".join("".join(chr(97 + c) for c in w) for w in letters) + "\n")
    out = tmp_path / "out"
    assert main(["--out", str(out), "--batches", "3", "--", "data=text", f"data.path={corpus}",
                 "data.document_mask=true", "seq_len=128", "model=tiny", "batch_size=2"]) == 0
    stats = json.loads((out / "document_lengths.json").read_text())
    assert stats["windows"] == 6 and stats["segments_per_window"] > 2 and stats["causal_work"] < 0.5
    assert (out / "document_lengths.png").stat().st_size > 0
    assert "of the causal (i, j) pairs" in (out / "document_lengths.md").read_text()


def test_windows_without_document_ids_are_refused_in_one_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--batches", "1", "--", "data=passkey", "seq_len=128", "model=tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "data.document_mask=true" in err
