"""data.passkey_fraction (minigpt/passkey_mix.py): the share of passkey examples measured on the batches a run gets,
what an example holds (the separator first, the eval's question, the key as the last tokens, one document), the rows
left alone, and the settings refused."""
import math
import re

import pytest
import torch

from minigpt.config import ConfigError, DataConfig
from minigpt.data import PasskeyData, build_data
from minigpt.eval.haystack import QUESTION
from test_data import write_corpus


def text_data(tmp_path, fraction, seq_len=160):
    corpus = write_corpus(tmp_path / "corpus", n_files=6, repeat=3000)
    cfg = DataConfig(name="text", path=str(corpus / "*.txt"), vocab_size=300, cache_dir=str(tmp_path / "cache"),
                     document_mask=True, passkey_fraction=fraction)
    return build_data(cfg, seq_len=seq_len, seed=3)


def test_the_share_of_passkey_examples_is_the_fraction_at_every_point_and_the_other_rows_are_unchanged(tmp_path):
    from tokenizers import Tokenizer

    mixed, plain = text_data(tmp_path, 0.1), text_data(tmp_path, 0.0)
    tok = Tokenizer.from_str(mixed.tokenizer_json)
    rows = examples = 0
    haystacks = set()
    for index in range(50):
        x, y, ids = mixed.batch("train", index, 7)
        px, _, pids = plain.batch("train", index, 7)
        for r in range(7):
            text = tok.decode(torch.cat([x[r], y[r, -1:]]).tolist())
            rows += 1
            if QUESTION not in text:
                assert torch.equal(x[r], px[r]) and (ids is None or torch.equal(ids[r], pids[r]))
                continue
            examples += 1
            key = re.search(r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", text).group(1)
            assert text.endswith(f"{QUESTION} {key}.") and (ids is None or ids[r].eq(0).all())  # one document
            assert x[r, 0] == mixed.eot  # the separator first, as minigpt-eval's prompts
            haystacks.add("filler" if "The grass is green." in text else "stream")
        assert math.floor(rows * 0.1) <= examples <= math.ceil(rows * 0.1)  # the share, to within one row
    assert examples == 35 and haystacks == {"filler", "stream"}
    assert all(QUESTION not in tok.decode(mixed.batch("val", i, 7)[0].flatten().tolist()) for i in range(5))
    again = text_data(tmp_path, 0.1)  # a pure function of (seed, split, index), as every batch
    assert all(torch.equal(a, b) for a, b in zip(again.batch("train", 9, 7)[:2], mixed.batch("train", 9, 7)[:2]))


def test_every_example_starts_with_the_separator_so_a_needle_at_cut_0_is_not_the_first_token(tmp_path):
    """Position 0 is the attention sink: an example starts with the end-of-text separator (what precedes every
    document of the stream, and every prompt of minigpt-eval's grid), then the haystack or, at cut 0, the needle."""
    from tokenizers import Tokenizer

    probe = text_data(tmp_path, 0.5)
    seq_len = probe.passkey.min_tokens() - 1  # the shortest allowed: a haystack of ~15 tokens, cut 0 is common
    data = text_data(tmp_path, 0.5, seq_len=seq_len)
    tok = Tokenizer.from_str(data.tokenizer_json)
    at_0 = 0
    for index in range(100):
        x, _, ids = data.batch("train", index, 4)
        for r in data.passkey.rows(index, 4):
            assert x[r, 0] == data.eot and (ids is None or ids[r].eq(0).all())  # the separator, in one document
            at_0 += tok.decode(x[r, 1:].tolist()).startswith(" The pass key is ")
    assert at_0 >= 5  # the needle right after the separator


def test_the_question_is_the_one_minigpt_eval_asks():
    question, _, end = PasskeyData.QUESTION.partition(" {key}")
    assert question == QUESTION and end == "."


@pytest.mark.parametrize("settings, says", [
    (dict(name="passkey", passkey_fraction=0.1), "data=passkey is all passkey examples"),
    (dict(name="text", path="x", passkey_fraction=0.6), r"must be in \[0, 0.5\]"),
    (dict(name="text", path="x", passkey_fraction=-0.1), r"must be in \[0, 0.5\]"),
])
def test_fractions_that_make_no_sense_are_refused(settings, says):
    with pytest.raises(ConfigError, match=says):
        DataConfig(**settings).validate()


def test_a_sequence_too_short_for_an_example_is_refused_with_the_length_it_needs(tmp_path):
    with pytest.raises(ConfigError, match=r"a passkey example needs seq_len >= \d+"):
        text_data(tmp_path, 0.05, seq_len=40)
