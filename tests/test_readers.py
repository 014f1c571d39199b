"""Reading text and documents piece by piece (corpus.read_chunks, read_text; readers.documents, scan_sources,
val_documents), with expected values worked out by hand or by hashlib: the pieces a file is cut into, the byte
offsets errors name, the reasons bad records get, what a scan counts per source."""

import hashlib
import io
import json
import re
from array import array
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gptlab.data import corpus, readers
from gptlab.data.corpus import Source, UnreadableSource, file_source, read_chunks, read_text
from gptlab.data.readers import Scan, documents, scan_sources, val_documents
from gptlab.errors import GptlabError


def in_memory(data: bytes, name: str = "mem.txt", kind: str = "text") -> Source:
    return Source(name, lambda: io.BytesIO(data), len(data), kind)


# ---- corpus.read_chunks / read_text: the one rule, in pieces ---------------------------------------------------

@pytest.mark.parametrize("data, pieces", [
    (b"ab\ncd\nef\ngh", ["ab\n", "cd\n", "ef\n", "gh"]),  # blocks "ab\nc" "d\nef" "\ngh": cut at the line break
    (b"a\nb\nc\nd\n", ["a\nb\n", "c\nd\n"]),  # two lines in a block: one piece, cut at the last break
    (b"abcdefghij", ["abcd", "efgh", "ij"]),  # no line break at all: a piece per block
])
def test_pieces_are_blocks_cut_back_to_their_last_line_break(monkeypatch, data, pieces):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 4)
    blocks = []
    assert list(read_chunks(in_memory(data), on_bytes=blocks.append)) == pieces
    assert b"".join(blocks) == data and max(map(len, blocks)) == 4


def test_characters_and_line_ends_cut_between_blocks_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 3)
    (tmp_path / "mixed.txt").write_bytes(b"\xef\xbb\xbf" + "café\r\n☕ naïve\rold mac\r".encode())
    assert read_text(tmp_path / "mixed.txt") == "café\n☕ naïve\nold mac\n"  # the last \r too, at the very end
    assert read_text(str(tmp_path / "mixed.txt"), "cp1252") == "ï»¿cafÃ©\nâ˜• naÃ¯ve\nold mac\n"


@pytest.mark.parametrize("chunk", [4, 1 << 20])
@pytest.mark.parametrize("data, offset", [
    (b"line one\nline two caf\xe9\n", 21),  # latin-1 e acute: 9 + 12 bytes before it
    (b"ab\xe2\x98x", 2),  # a 3-byte character cut short, its first two bytes in the block before
    (b"\xef\xbb\xbfcaf\xe9 x", 6),  # after a byte-order mark, which the decoder drops
    (b"caf\xc3", 3),  # cut off by the end of the file
])
def test_a_bad_byte_is_named_by_its_offset_in_the_file(tmp_path, monkeypatch, chunk, data, offset):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", chunk)
    (tmp_path / "bad.txt").write_bytes(data)
    message = (rf"^{tmp_path / 'bad.txt'} is not valid utf-8: bad byte at offset {offset}; pass --encoding with "
               r"the file's real encoding \(e\.g\. latin-1\)$")
    with pytest.raises(UnreadableSource, match=message):
        read_text(tmp_path / "bad.txt")
    with pytest.raises(UnreadableSource, match=message):
        list(read_chunks(in_memory(data, str(tmp_path / "bad.txt"))))


def test_a_nul_is_binary_named_near_its_offset(monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 4)
    with pytest.raises(UnreadableSource, match=r"^mem.txt looks like a binary file \(a NUL byte near offset 9\); "
                                               "give a text file$"):
        list(read_chunks(in_memory(b"text\nmore\x00")))  # blocks "text" "\nmor" "e\x00": the NUL is byte 9
    with pytest.raises(UnreadableSource, match=r"a NUL byte near offset 4\)"):  # UTF-7 spells NUL +AAA-: no NUL
        list(read_chunks(in_memory(b"abc+AAA-def"), "utf-7"))  # byte in the block "AAA-" it is decoded in


def test_read_text_refuses_a_missing_path_a_folder_and_an_unknown_encoding(tmp_path):
    with pytest.raises(GptlabError, match=rf"^{tmp_path / 'nope.txt'} does not exist$"):
        read_text(tmp_path / "nope.txt")
    with pytest.raises(GptlabError, match=rf"^{tmp_path} is not a file$"):
        read_text(tmp_path)
    (tmp_path / "a.txt").write_text("text\n")
    with pytest.raises(GptlabError, match=r"^unknown text encoding 'klingon'; try utf-8, latin-1 or cp1252$"):
        read_text(tmp_path / "a.txt", "klingon")


def test_a_codec_that_takes_only_strict_errors_reads_too(tmp_path):
    (tmp_path / "hosts.txt").write_bytes(b"www.xn--caf-dma.example\r\n")  # IDNA refuses any errors= but "strict"
    assert read_text(tmp_path / "hosts.txt", "idna") == "www.café.example\n"


def test_a_damaged_compressed_file_says_so(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UnreadableSource, match=rf"^{tmp_path / 'a.txt.gz'} could not be decompressed \(.*\); it is "
                                               "damaged or not the kind of file its name says$"):
        list(read_chunks(file_source(tmp_path / "a.txt.gz")))


# ---- readers.documents ------------------------------------------------------------------------------------------

BAD_LINES = [  # (line, the reason it gets), each bad in its own way
    ('["a list", "not an object"]', "has no text field 'text' (its fields: none: not an object)"),
    ("3", "has no text field 'text' (its fields: none: not an object)"),
    ('{"text": 42}', "has text field 'text' 42, not a string"),
    ('{"text": ["aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc", "dd"]}',  # the value cut to its first 40 characters
     """has text field 'text' ["aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc, not a string"""),
    (json.dumps({f"f{i}": i for i in range(10)}), "has no text field 'text' (its fields: f0, f1, f2, f3, f4, f5, f6, f7)"),
    ('{"text": "cut off', "is not JSON"),
]


def test_json_lines_give_a_document_per_good_record_and_a_reason_per_bad_one(monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 16)  # lines longer than a block
    lines = ['{"id": 1, "text": "café ☕"}', ""] + [line for line, _ in BAD_LINES] + [
        '{"text": "", "id": 2}', '{"title": "x", "text": "last, no newline"}']
    bad, seen = [], []
    docs = [list(d) for d in documents(in_memory("\n".join(lines).encode(), "m.jsonl", "jsonl"), on_bytes=seen.append,
                                        on_bad=lambda *a: bad.append(a))]
    assert docs == [["café ☕"], ["last, no newline"]] and b"".join(seen) == "\n".join(lines).encode()
    assert bad == [(n, f"m.jsonl line {n} {reason}") for n, (_, reason) in enumerate(BAD_LINES, 3)]


def test_a_bad_last_line_without_a_newline_is_counted_with_its_number():
    bad = []
    data = b'{"text": "one"}\n{"text": "two"}\n{"txt": "three"}'
    assert [list(d) for d in documents(in_memory(data, "m.jsonl", "jsonl"), on_bad=lambda *a: bad.append(a))] == [
        ["one"], ["two"]]
    assert bad == [(3, "m.jsonl line 3 has no text field 'text' (its fields: txt)")]
    with pytest.raises(UnreadableSource, match="^mem.txt is not valid utf-8: bad byte at offset 3"):
        [list(d) for d in documents(in_memory(b"caf\xe9 au lait"))]  # utf-8 by default


def write_parquet(path: Path, columns: dict, **kwargs) -> Path:
    pq.write_table(pa.table(columns), path, **kwargs)
    return path


@pytest.mark.parametrize("text_type", [pa.string(), pa.large_string()])  # polars writes large_string
def test_parquet_rows_are_documents_from_the_named_column_batch_by_batch(tmp_path, monkeypatch, text_type):
    monkeypatch.setattr(readers, "PARQUET_BATCH_ROWS", 2)
    texts = ["uno", "", "dos ☕", None, "tres", "quatre"]
    path = write_parquet(tmp_path / "t.parquet", {"id": list(range(6)), "body": pa.array(texts, text_type)})
    seen = []
    docs = [list(d) for d in documents(file_source(path), text_field="body", on_bytes=seen.append)]
    assert docs == [["uno"], ["dos ☕"], ["tres"], ["quatre"]]  # the empty and null rows left out
    assert seen == [t.encode() for t in ("uno", "dos ☕", "tres", "quatre")]


def test_parquet_without_a_string_text_column_or_damaged_is_unreadable(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "PARQUET_BATCH_ROWS", 10)
    path = write_parquet(tmp_path / "n.parquet", {f"c{i}": [i] for i in range(9)} | {"text": [1]})
    with pytest.raises(UnreadableSource, match=rf"^{path} has no text column 'text' \(its columns: c0, c1, c2, c3, "
                                               r"c4, c5, c6, c7\); pass --text-field with the one that holds the text$"):
        list(documents(file_source(path)))
    (tmp_path / "x.parquet").write_text("a,b\n1,2\n")
    with pytest.raises(UnreadableSource, match=rf"^{tmp_path / 'x.parquet'} is not a readable Parquet file \(.+\)$"):
        list(documents(file_source(tmp_path / "x.parquet")))
    damaged = write_parquet(tmp_path / "d.parquet", {"text": [f"row {i} " * 20 for i in range(200)]},
                            row_group_size=50)
    chunk = pq.ParquetFile(damaged).metadata.row_group(2).column(0)  # the third row group's pages overwritten
    start, raw = chunk.dictionary_page_offset or chunk.data_page_offset, bytearray(damaged.read_bytes())
    raw[start:start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    damaged.write_bytes(raw)
    docs = documents(file_source(damaged))
    assert [next(docs) for _ in range(100)][-1] == ("row 99 " * 20,)
    with pytest.raises(UnreadableSource, match=rf"^{damaged} is damaged \("):
        next(docs)


# ---- readers.scan_sources, Scan.joined, val_documents ----------------------------------------------------------

def test_a_scan_counts_each_source_and_skips_what_it_cannot_read(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 4)  # several blocks a file
    files = {"a.jsonl": '{"text": "héllo"}\nnot json\n{"text": "wörld ☕"}\n'.encode(), "b.bin": b"\x00\x01\x02",
             "c.txt": b"", "d.txt": "línea\n".encode() * 5, "e.jsonl": b'{"id": 1}\n{"text": "x"}'}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    write_parquet(tmp_path / "f.parquet", {"text": ["pa", "rquet ☕"]})
    read = [b"pa" + "rquet ☕".encode() if p.suffix == ".parquet" else files[p.name] for p in sorted(tmp_path.iterdir())]
    progress = []
    scan = scan_sources([file_source(p, found=True) for p in sorted(tmp_path.iterdir())], "utf-8", "text", False,
                        progress.append, False)
    path = {name: str(tmp_path / name) for name in [*files, "f.parquet"]}
    assert [s.name for s in scan.sources] == [path[n] for n in ("a.jsonl", "c.txt", "d.txt", "e.jsonl", "f.parquet")]
    assert [(d["path"], d["documents"], d["chars"]) for d in scan.described] == [
        (path["a.jsonl"], 2, 12), (path["c.txt"], 0, 0), (path["d.txt"], 1, 30), (path["e.jsonl"], 1, 1),
        (path["f.parquet"], 2, 9)]
    kept = [data for name, data in zip(sorted(path), read) if name != "b.bin"]
    assert [(d["bytes"], d["sha256"]) for d in scan.described] == [(len(b), hashlib.sha256(b).hexdigest()) for b in kept]
    assert scan.total == 12 + 30 + 1 + 9 and scan.chars == set("héllowörld ☕" + "línea\n" + "x" + "parquet")
    assert list(scan.lengths) == [5, 7, 30, 1, 2, 7]  # each document's characters, in reading order
    assert sum(progress) == sum(map(len, read)) and scan.val_from is None
    assert scan.skipped == [{"path": path["b.bin"], "reason": f"{path['b.bin']} looks like a binary file (a NUL byte "
                                                              "near offset 0); give a text file"}]
    assert scan.bad_records == [
        {"path": path["a.jsonl"], "line": 2, "reason": f"{path['a.jsonl']} line 2 is not JSON"},
        {"path": path["e.jsonl"], "line": 1, "reason": f"{path['e.jsonl']} line 1 has no text field 'text' (its fields: id)"}]


def scan_one(path: Path, strict: bool = False, found: bool = False) -> Scan:
    return scan_sources([file_source(path, found)], "utf-8", "text", strict, lambda n: None, False)


def test_strict_refuses_a_bad_record_and_says_what_happens_without_it(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n{"text": null}\n')
    assert scan_one(path).bad_records == [{"path": str(path), "line": 2,
                                           "reason": f"{path} line 2 has text field 'text' null, not a string"}]
    with pytest.raises(UnreadableSource, match=rf"^{path} line 2 has text field 'text' null, not a string; --strict "
                                               r"refuses a bad record \(without it, bad records are left out and "
                                               r"counted\)$"):
        scan_one(path, strict=True)


def test_the_end_of_text_marker_is_refused_only_when_asked(tmp_path):
    (tmp_path / "a.txt").write_text("one document<|endoftext|>another\n")
    source = file_source(tmp_path / "a.txt")
    assert scan_sources([source], "utf-8", "text", False, lambda n: None, False).described[0]["documents"] == 1
    with pytest.raises(GptlabError, match=rf"^{source.name} contains the text <\|endoftext\|>, which this tokenizer "
                                          "reserves for the end of a document; pass --allow-special"):
        scan_sources([source], "utf-8", "text", False, lambda n: None, True)


@pytest.mark.parametrize("lines, hint", [
    (["not json at all"], "a .jsonl / .json file must hold one JSON object per line"),
    (["nope", '{"id": 1}'], "a .jsonl / .json file must hold one JSON object per line"),  # as its first line says
    (['{"id": 1}', "nope"], "pass --text-field with the one that holds the text"),
])
def test_json_lines_without_one_good_record_are_unreadable_with_a_hint_from_the_first_bad_line(tmp_path, lines, hint):
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines))
    first = "is not JSON" if lines[0].startswith("n") else "has no text field 'text' (its fields: id)"
    with pytest.raises(UnreadableSource, match=rf"^{path} line 1 {re.escape(first)}, and no line of it is a good "
                                               rf"record; {re.escape(hint)}$"):
        scan_one(path)
    assert scan_one(path, found=True).skipped[0]["path"] == str(path)


def test_a_joined_scan_is_the_corpus_then_the_validation_corpus():
    a, b, c = (in_memory(t.encode(), f"{t}.txt") for t in "abc")
    corpus_scan = Scan([a], 10, [{"documents": 2}], {"x", "y"}, [{"path": "s1", "reason": "r1"}], None,
                       [{"path": "p1", "line": 1, "reason": "q1"}], array("q", [4, 6]))
    val_scan = Scan([b, c], 5, [{"documents": 1}, {"documents": 3}], {"y", "z"}, [{"path": "s2", "reason": "r2"}],
                    None, [{"path": "p2", "line": 7, "reason": "q2"}], array("q", [2, 1, 1, 1]))
    assert corpus_scan.joined(val_scan) == Scan(
        [a, b, c], 15, [{"documents": 2}, {"documents": 1}, {"documents": 3}], {"x", "y", "z"},
        [{"path": "s1", "reason": "r1"}, {"path": "s2", "reason": "r2"}], 1,
        [{"path": "p1", "line": 1, "reason": "q1"}, {"path": "p2", "line": 7, "reason": "q2"}],
        array("q", [4, 6, 2, 1, 1, 1]))
    assert corpus_scan.lengths == array("q", [4, 6]) and corpus_scan.documents == 2  # left as they were


def counted(*documents_per_source: int, val_from: int | None = None, lengths: list[int] | None = None) -> Scan:
    lengths = [1] * sum(documents_per_source) if lengths is None else lengths
    return Scan([], sum(lengths), [{"documents": n} for n in documents_per_source], set(), [], val_from,
                lengths=array("q", lengths))


def test_the_validation_corpus_is_every_document_from_its_first_source_on():
    for val_from, held in ((2, [0, 0, 0, 0, 0, 1]), (1, [0, 0, 1, 1, 1, 1])):
        mask = val_documents(counted(2, 3, 1, val_from=val_from), 0.1, 0)
        assert mask.dtype == np.bool_ and mask.tolist() == [bool(h) for h in held]


def test_documents_alike_in_size_are_held_out_by_count_else_none():
    for counts, fraction, k in (((4, 6), 0.1, 1), ((40,), 0.5, 20), ((1, 12, 29), 0.2, 8)):
        mask = val_documents(counted(*counts), fraction, 3)
        assert mask.dtype == np.bool_ and mask.shape == (sum(counts),) and mask.sum() == k
    assert val_documents(counted(4, 5), 0.1, 0) is None  # 9 documents: none fits in 0.9 of one, split by characters
    again, other = (val_documents(counted(40), 0.5, seed).tolist() for seed in (3, 4))
    assert again == val_documents(counted(40), 0.5, 3).tolist() != other  # chosen by the seed alone


def test_documents_of_any_sizes_are_held_out_until_they_hold_the_fraction_of_the_characters():
    """Documents in an order drawn by the seed, each taken while it fits in what is left of val_fraction of the
    characters (round(25,800 x 0.1) = 2,580): the short ones fill the gap the long ones leave, to within one."""
    lengths = [10] * 180 + [1000] * 24
    chosen = []
    for seed in range(8):
        mask = val_documents(counted(150, 54, lengths=lengths), 0.1, seed)
        assert mask.dtype == np.bool_ and 2580 - 10 < np.asarray(lengths)[mask].sum() <= 2580
        chosen.append(mask.tolist())
    assert len({tuple(m) for m in chosen}) == 8 and val_documents(counted(204, lengths=lengths), 0.1, 5).tolist() == \
        chosen[5]  # each seed its own choice, and the same again


@pytest.mark.parametrize("lengths, fraction", [
    ([10] * 9, 0.1),  # none fits in 9 characters
    ([1, 100, 100], 0.1),  # only 1 of the 20 fits: far below the fraction
    ([30, 30, 30, 30], 0.25),  # one whole document is exactly a quarter: taken, for contrast
])
def test_documents_that_cannot_come_near_the_fraction_split_by_characters(lengths, fraction):
    mask = val_documents(counted(len(lengths), lengths=lengths), fraction, 0)
    if lengths[0] == 30:
        assert mask.sum() == 1
    else:
        assert mask is None
