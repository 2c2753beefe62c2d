from __future__ import annotations

import json

import pytest

from leapfrog.errors import ConfigError
from leapfrog.train.corpus import Document, pack_stream, read_documents, split_by_file, stdlib_documents


def test_split_by_file_has_no_file_in_both_halves():
    docs = [Document(f"pkg/m{i}.py", f"x = {i}\n") for i in range(500)]
    train, held = split_by_file(docs, 0.1, seed=3)
    names_t, names_h = {d.name for d in train}, {d.name for d in held}
    assert not names_t & names_h
    assert names_t | names_h == {d.name for d in docs}
    assert 20 < len(held) < 90                           # about 10 %
    # the split depends on names and seed only, not on the order of the list
    train2, held2 = split_by_file(list(reversed(docs)), 0.1, seed=3)
    assert {d.name for d in held2} == names_h
    assert {d.name for d in split_by_file(docs, 0.1, seed=4)[1]} != names_h


def test_split_holds_out_at_least_one_file():
    docs = [Document("a.py", "a"), Document("b.py", "b")]
    train, held = split_by_file(docs, 0.01)
    assert len(held) == 1 and len(train) == 1


def test_stdlib_documents_are_the_standard_library():
    docs = stdlib_documents()
    names = {d.name for d in docs}
    assert "textwrap.py" in names and "json/__init__.py" in names
    assert not any("site-packages" in n for n in names)


def test_read_documents_formats(tmp_path, tokenizer):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "def f(): pass"}) + "\n\n"
                                      + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    docs = read_documents(tmp_path / "a.jsonl")
    assert [d.text for d in docs] == ["def f(): pass", "hi"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.py").write_text("import os\n")
    (tmp_path / "d" / "y.bin").write_bytes(b"\0\1")
    assert [d.name for d in read_documents(tmp_path / "d")] == ["x.py"]
    stream = pack_stream(tokenizer, docs)
    assert stream.tolist().count(tokenizer.eos_token_id) == 2
    with pytest.raises(ConfigError, match="no such file"):
        read_documents(tmp_path / "missing")
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(ConfigError, match="'text', 'prompt' or 'messages'"):
        read_documents(tmp_path / "bad.jsonl")


def test_corpus_files_that_are_not_utf8_are_named(tmp_path):
    """Not UTF-8 (a Latin-1 file, a binary .txt) is a ConfigError naming the file, in a folder too:
    it used to be trained on as replacement characters. A JSONL corpus's errors say "corpus"."""
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    with pytest.raises(ConfigError, match=r"corpus file .*latin1\.txt: not UTF-8"):
        read_documents(tmp_path / "latin1.txt")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "ok.py").write_text("import os\n")
    (tmp_path / "d" / "blob.txt").write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=r"blob\.txt: not UTF-8"):
        read_documents(tmp_path / "d")
    (tmp_path / "x.jsonl").write_text("{oops\n")
    with pytest.raises(ConfigError, match="a corpus file is JSONL"):
        read_documents(tmp_path / "x.jsonl")


def test_nothing_held_out_is_said(capsys):
    from leapfrog.train.corpus import Document, heldout_or_training
    docs = [Document("a", "x"), Document("b", "y")]
    assert heldout_or_training(docs, docs[:1]) == docs[:1] and capsys.readouterr().err == ""
    assert heldout_or_training(docs, []) == docs[-1:]
    assert "measured on training text" in capsys.readouterr().err


def test_token_id_documents_need_no_tokenizer(tmp_path, tokenizer):
    (tmp_path / "ids.jsonl").write_text(json.dumps({"token_ids": [5, 6, 7]}) + "\n" + json.dumps({"token_ids": []})
                                        + "\n" + json.dumps({"token_ids": [8]}) + "\n")
    docs = read_documents(tmp_path / "ids.jsonl")
    assert [d.token_ids for d in docs] == [(5, 6, 7), (8,)] and docs[0].text == ""   # the empty one is dropped
    assert pack_stream(None, docs, eos_token_id=2).tolist() == [5, 6, 7, 2, 8, 2]
    assert pack_stream(None, docs).tolist() == [5, 6, 7, 8]
    # mixed with text: the tokenizer encodes the text, ids pass through, order kept
    mixed = [Document("a", "import os"), docs[0]]
    ids = pack_stream(tokenizer, mixed).tolist()
    assert ids == tokenizer.encode("import os", add_special_tokens=False) + [tokenizer.eos_token_id, 5, 6, 7,
                                                                            tokenizer.eos_token_id]
    with pytest.raises(ConfigError, match="no tokenizer"):
        pack_stream(None, mixed)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"token_ids": [1, -2]}) + "\n")
    with pytest.raises(ConfigError, match="non-negative integers"):
        read_documents(tmp_path / "bad.jsonl")
    (tmp_path / "huge.jsonl").write_text(json.dumps({"token_ids": [3, 10**30]}) + "\n")   # (an int64 overflow)
    with pytest.raises(ConfigError, match=r"huge\.jsonl:1: token id 10+ is no token id"):
        read_documents(tmp_path / "huge.jsonl")
    for completion in (5, ["x"]):   # (a TypeError)
        (tmp_path / "c.jsonl").write_text(json.dumps({"prompt": "a", "completion": completion}) + "\n")
        with pytest.raises(ConfigError, match=r"c\.jsonl:1: 'completion' must be a string"):
            read_documents(tmp_path / "c.jsonl")
