"""Load documents (PDF or UTF-8 text) into one normalised string with a page map.

A :class:`Document` is the unit everything downstream works on: its ``text`` is what gets
tokenised and cached, and its ``pages`` map character offsets back to physical pages and
their printed labels so answers can cite "p. iv" or "p. 12".

Text is NFKC-normalised so that ligatures and other compatibility characters that PDF
extraction produces ("ﬁ", full-width digits, non-breaking spaces) tokenise like ordinary text.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import logging
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pypdf
from pypdf.errors import DependencyError

from semanticache_rag.errors import DocumentError

logger = logging.getLogger(__name__)

__all__ = ["Document", "Page", "document_from_bytes", "document_from_text", "load_document", "looks_glued", "read_pdf"]

PAGE_SEPARATOR = "\n\n"
TEXT_SUFFIXES = frozenset({".txt", ".md", ".markdown", ".rst", ".text"})
KNOWN_SUFFIXES = TEXT_SUFFIXES | {".pdf"}
SUPPORTED_FORMATS = "PDF (.pdf) or UTF-8 text (" + ", ".join(sorted(TEXT_SUFFIXES)) + ")"
# Longer strings are document text, never a path (PATH_MAX is 4096 on Linux).
_MAX_PATH_CHARS = 4096

# -- glued-word heuristic -------------------------------------------------------------------
# Some PDFs (e.g. Debian's policy.pdf) declare a wide space glyph and position words with small
# TJ offsets; pypdf then emits "Thepackagemustbe...". Normal prose, code and URLs almost never
# have letter runs of >= 20 chars once camelCase is split. Letter-weighted fraction in such
# runs: <= 0.03 over ~860 text files (licences, stdlib .py, READMEs, /usr/share/doc), <= 0.084
# over 120 real PDFs through pypdf (TeX Live docs, R vignettes); 0.43 for policy.pdf, 0.74 for
# GPL-3 with its spaces removed, 0.38 with every other line glued.
_GLUED_RUN_CHARS = 20
_GLUED_THRESHOLD = 0.25
_GLUED_MIN_LETTERS = 100
# Scripts written with spaces between words; CJK and Thai never use spaces, so they are ignored.
_SPACED_LETTERS = re.compile("[A-Za-z\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff]+")
_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z])(?=[A-Z])")
_URL_OR_EMAIL = re.compile(r"\S*(?:://|www\.|@)\S*")


@dataclass(frozen=True)
class Page:
    """One physical page of a :class:`Document`.

    Attributes
    ----------
    number : int
        1-based physical page number.
    label : str
        The PDF page label (e.g. ``"iv"``), else ``str(number)``.
    start, end : int
        Character span ``[start, end)`` of the page's text in :attr:`Document.text`.
    """

    number: int
    label: str
    start: int
    end: int


@dataclass(frozen=True)
class Document:
    """A loaded document: normalised text plus where each page lies in it.

    Attributes
    ----------
    text : str
        Full text, NFKC-normalised, pages joined with ``"\\n\\n"``.
    pages : tuple of Page
        One per page, in order; a plain-text document is one page.
    name : str
        File name, or ``"text"`` for raw strings.
    source : str or None
        Absolute path of the file, or None for raw text.
    sha256 : str
        Hex SHA-256 of ``text`` encoded as UTF-8; identifies the content for caching.
    extractor : str
        ``"pypdf"``, ``"pypdfium2"`` or ``"text"``.
    """

    text: str
    pages: tuple[Page, ...]
    name: str
    source: str | None
    sha256: str
    extractor: str

    @property
    def total_pages(self) -> int:
        """Number of physical pages."""
        return len(self.pages)

    def page_at(self, offset: int) -> Page:
        """Return the page containing character ``offset`` of :attr:`text`.

        Offsets in the separator after a page belong to that page, and ``len(text)`` maps to
        the last page so exclusive end offsets can be looked up too.

        Raises
        ------
        ValueError
            If ``offset`` is outside ``[0, len(text)]``.
        """
        if not 0 <= offset <= len(self.text):
            raise ValueError(f"offset {offset} is outside [0, {len(self.text)}] for {self.name}")
        index = bisect.bisect_right(self.pages, offset, key=lambda page: page.start) - 1
        return self.pages[max(index, 0)]


def load_document(source: str | os.PathLike[str] | Document) -> Document:
    """Load a document from a path, raw text, or an existing :class:`Document`.

    Parameters
    ----------
    source : str, os.PathLike or Document
        A Document is returned as is. A path (``os.PathLike``) is read from disk (PDF or UTF-8
        text). A string is a file name only when it is one short line ending in a document
        suffix (``.pdf``, ``.txt``, ``.md``, ...), and then the file must exist; any other
        string is the document text itself, so text from a user (``"/etc/passwd"``,
        ``"~/.ssh/id_rsa"``) is never read from disk. Pass a :class:`~pathlib.Path` to read a
        file of another name.

    Returns
    -------
    Document

    Raises
    ------
    DocumentError
        If the file is missing, unreadable, of an unsupported format, or has no text.
    """
    if isinstance(source, Document):
        return source
    if isinstance(source, os.PathLike):
        return _read_file(Path(source).expanduser())
    if not isinstance(source, str):
        raise TypeError(f"expected a path, text or Document, got {type(source).__name__}")
    if _names_document_file(source):
        return _read_file(Path(source).expanduser())
    return document_from_text(source)


def document_from_text(text: str, name: str = "text", source: str | None = None) -> Document:
    """Build a one-page :class:`Document` from raw text.

    Raises
    ------
    DocumentError
        If the text is empty or whitespace only.
    """
    return _assemble([_normalise(text)], ["1"], name=name, source=source, extractor="text")


def read_pdf(path: str | os.PathLike[str]) -> Document:
    """Read a PDF with pypdf, re-extracting with pypdfium2 when pypdf glues words together.

    Encrypted PDFs are opened with the empty password, which is all that PDFs protected only
    by an owner (permissions) password need.

    Raises
    ------
    DocumentError
        If the file is missing, corrupt, password-protected, has no pages, or has no
        extractable text (image-only scans).
    """
    path = Path(path).expanduser()
    return _pdf_document(_read_bytes(path), path, str(path.resolve()))


def looks_glued(text: str) -> bool:
    """Whether ``text`` looks like words were extracted without the spaces between them.

    Measures the fraction of letters (in space-separated scripts) that sit in runs of at
    least 20 letters after splitting camelCase and dropping URLs and e-mail addresses.
    """
    text = _CAMEL_BOUNDARY.sub(" ", _URL_OR_EMAIL.sub(" ", text))
    runs = [len(run) for run in _SPACED_LETTERS.findall(text)]
    letters = sum(runs)
    if letters < _GLUED_MIN_LETTERS:
        return False
    long_letters = sum(run for run in runs if run >= _GLUED_RUN_CHARS)
    return long_letters / letters >= _GLUED_THRESHOLD


# -- files ----------------------------------------------------------------------------------


def _names_document_file(text: str) -> bool:
    """Whether a string is a document's file name rather than its text (see :func:`load_document`)."""
    if not text or "\n" in text or len(text) >= _MAX_PATH_CHARS:
        return False
    return text == text.strip() and Path(text).suffix.lower() in KNOWN_SUFFIXES


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # name too long, embedded NUL: not a path after all
        return False


def _read_bytes(path: Path) -> bytes:
    if not _exists(path):
        raise DocumentError(f"no such file: {path}")
    if path.is_dir():
        raise DocumentError(f"{path} is a directory; pass a {SUPPORTED_FORMATS} file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DocumentError(f"cannot read {path}: {exc.strerror or exc}") from exc


def document_from_bytes(data: bytes, name: str, source: str | None = None) -> Document:
    """A document from a file's bytes (an upload): a PDF (its magic bytes or a ``.pdf`` name) or UTF-8 text.

    ``name`` is only a label: its last component names the document and nothing is read from disk.

    Raises
    ------
    DocumentError
        As :func:`load_document` does for a file with these bytes.
    """
    label = Path(Path(str(name)).name or "upload")
    return _document_from_bytes(data, label, source)


def _read_file(path: Path) -> Document:
    return _document_from_bytes(_read_bytes(path), path, str(path.resolve()))


def _document_from_bytes(data: bytes, path: Path, source: str | None) -> Document:
    suffix = path.suffix.lower()
    if suffix == ".pdf" or data.startswith(b"%PDF-"):
        return _pdf_document(data, path, source)
    if suffix not in TEXT_SUFFIXES and b"\x00" in data[:8192]:
        raise DocumentError(f"{path} is not a supported format; use {SUPPORTED_FORMATS}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        if suffix not in TEXT_SUFFIXES:
            raise DocumentError(f"{path} is not a supported format; use {SUPPORTED_FORMATS}") from exc
        raise DocumentError(
            f"{path} is not valid UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start});"
            " save it as UTF-8 and try again"
        ) from exc
    return document_from_text(text, name=path.name, source=source)


# -- PDF ------------------------------------------------------------------------------------


def _pdf_document(data: bytes, path: Path, source: str | None) -> Document:
    page_texts, labels = _pypdf_pages(data, path)
    extractor = "pypdf"
    if looks_glued(PAGE_SEPARATOR.join(page_texts)):
        page_texts, extractor = _unglue(data, path, page_texts)
    if not any(text.strip() for text in page_texts):
        raise DocumentError(
            f"{path} has no extractable text; it looks image-only (scanned)."
            " Run OCR on it first, e.g. `ocrmypdf in.pdf out.pdf`"
        )
    return _assemble(page_texts, labels, name=path.name, source=source, extractor=extractor)


def _pypdf_pages(data: bytes, path: Path) -> tuple[list[str], list[str]]:
    """Per-page normalised text and page labels, with pypdf's many errors made DocumentErrors."""
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            _decrypt(reader, path)
        if len(reader.pages) == 0:
            raise DocumentError(f"{path} has no pages")
        texts = [_page_text(page, number, path) for number, page in enumerate(reader.pages, 1)]
        return texts, _page_labels(reader, len(texts))
    except DocumentError:
        raise
    except DependencyError as exc:
        # AES-encrypted PDFs need a crypto backend; pypdf ships only RC4 in pure Python.
        raise DocumentError(
            f"{path} is AES-encrypted and reading it needs the `cryptography` package: pip install cryptography"
        ) from exc
    except Exception as exc:  # pypdf raises builtin errors too (KeyError, ValueError, ...)
        raise DocumentError(f"{path} is not a readable PDF: {exc}") from exc


def _decrypt(reader: pypdf.PdfReader, path: Path) -> None:
    # Many PDFs are encrypted only with an owner password; the empty user password opens them.
    if reader.decrypt("") == pypdf.PasswordType.NOT_DECRYPTED:
        raise DocumentError(
            f"{path} is password-protected; decrypt it first, e.g. `qpdf --decrypt --password=PASSWORD in.pdf out.pdf`"
        )


def _page_text(page: pypdf.PageObject, number: int, path: Path) -> str:
    try:
        text = page.extract_text()
    except DependencyError:
        raise
    except Exception as exc:  # one malformed content stream should not lose the document
        logger.warning("%s: cannot extract text from page %d (%s); using none", path, number, exc)
        return ""
    return _normalise(text or "").strip()


def _page_labels(reader: pypdf.PdfReader, count: int) -> list[str]:
    fallback = [str(number) for number in range(1, count + 1)]
    try:
        labels = list(reader.page_labels)
    except Exception as exc:  # a broken /PageLabels tree only costs us the labels
        logger.warning("ignoring unreadable page labels (%s)", exc)
        return fallback
    if len(labels) != count:
        return fallback
    return [label or default for label, default in zip(labels, fallback, strict=True)]


def _unglue(data: bytes, path: Path, page_texts: list[str]) -> tuple[list[str], str]:
    """Re-extract glued pypdf text with pypdfium2 when it is installed and does better."""
    try:
        import pypdfium2  # noqa: F401  (optional dependency, imported only when needed)
    except ImportError:
        logger.warning(
            "%s: words appear glued together in the extracted text (pypdf lost the spaces);"
            ' `pip install pypdfium2` (or `pip install "semanticache-rag[pdf]"`) to extract it better',
            path,
        )
        return page_texts, "pypdf"
    try:
        pdfium_texts = _pdfium_pages(data)
    except Exception as exc:  # pypdfium2 raises its own PdfiumError and friends
        logger.warning("%s: pypdfium2 could not re-extract glued text (%s)", path, exc)
        return page_texts, "pypdf"
    if len(pdfium_texts) != len(page_texts) or looks_glued(PAGE_SEPARATOR.join(pdfium_texts)):
        logger.warning("%s: words appear glued together, even with pypdfium2", path)
        return page_texts, "pypdf"
    logger.info("%s: pypdf glued words together; using pypdfium2's text", path)
    return pdfium_texts, "pypdfium2"


def _pdfium_pages(data: bytes) -> list[str]:
    import pypdfium2

    pdf = pypdfium2.PdfDocument(data)
    try:
        texts = []
        for index in range(len(pdf)):
            page = pdf[index]
            textpage = page.get_textpage()
            # pdfium marks a hyphen that broke a word across lines with U+FFFE (\x02 in older
            # builds) and joins the halves; dropping the mark restores the word.
            text = textpage.get_text_range().replace("\ufffe", "").replace("\x02", "")
            texts.append(_normalise(text).strip())
            textpage.close()
            page.close()
        return texts
    finally:
        pdf.close()


# -- assembly -------------------------------------------------------------------------------


def _normalise(text: str) -> str:
    text = text.replace("\x00", "").replace("\r\n", "\n").replace("\r", "\n")
    return unicodedata.normalize("NFKC", text)


def _assemble(page_texts: list[str], labels: list[str], *, name: str, source: str | None, extractor: str) -> Document:
    """Join normalised page texts with PAGE_SEPARATOR and record each page's span."""
    text = PAGE_SEPARATOR.join(page_texts)
    if not text.strip():
        raise DocumentError(f"document is empty: {source or name}")
    pages, start = [], 0
    for number, (page_text, label) in enumerate(zip(page_texts, labels, strict=True), start=1):
        pages.append(Page(number=number, label=label, start=start, end=start + len(page_text)))
        start += len(page_text) + len(PAGE_SEPARATOR)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return Document(text, tuple(pages), name, source, digest, extractor)
