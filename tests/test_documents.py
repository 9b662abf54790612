"""Tests for semanticache_rag.documents, on tiny PDFs written by hand in each test."""

from __future__ import annotations

import hashlib
import io
import logging
import sys
import unicodedata
from pathlib import Path

import pypdf
import pytest
from pypdf.errors import DependencyError

from semanticache_rag import documents
from semanticache_rag.documents import (
    Document,
    Page,
    document_from_text,
    load_document,
    looks_glued,
    read_pdf,
)
from semanticache_rag.errors import DocumentError

GPL3 = Path("/usr/share/common-licenses/GPL-3")
PARAGRAPH = (
    "The licenses for most software and other practical works are designed to take away your "
    "freedom to share and change the works. By contrast, the GNU General Public License is "
    "intended to guarantee your freedom to share and change all versions of a program--to make "
    "sure it remains free software for all its users. We, the Free Software Foundation, use the "
    "GNU General Public License for most of our software; it applies also to any other work "
    "released this way by its authors. You can apply it to your programs, too."
)
GLUED_WORDS = (
    "The package must be installed before the maintainer scripts run and every configuration "
    "file it ships must be listed so that the package manager can preserve local changes made "
    "by the administrator during upgrades of the system"
).split()


# -- a minimal PDF writer: catalog, page tree, one Helvetica font, one content stream a page --


def _pdf_string(text: str) -> bytes:
    escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
    return b"(" + escaped.encode("latin-1") + b")"


def _content(text: str, glued: bool) -> bytes:
    """Draw each line of ``text``; ``glued`` spaces words by TJ offsets instead of spaces."""
    ops = [b"BT /F1 12 Tf 14 TL 72 720 Td"]
    for line in text.splitlines():
        if glued:
            # -300/1000 em is a visible gap but under half the font's (declared) space width,
            # so pypdf adds no space: the way Debian's policy.pdf comes out glued.
            ops.append(b"[" + b" -300 ".join(_pdf_string(w) for w in line.split()) + b"] TJ T*")
        else:
            ops.append(_pdf_string(line) + b" Tj T*")
    ops.append(b"ET")
    return b"\n".join(ops)


def make_pdf(page_texts: list[str], labels: bytes = b"", glued: bool = False) -> bytes:
    """Bytes of a PDF with one page per text; ``labels`` is the body of /PageLabels /Nums."""
    widths = " ".join(["1000" if glued else "278"] + ["556"] * 94)
    catalog = b"<< /Type /Catalog /Pages 2 0 R"
    if labels:
        catalog += b" /PageLabels << /Nums [" + labels + b"] >>"
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(len(page_texts)))
    font_id = 3 + 2 * len(page_texts)
    objects = [catalog + b" >>", f"<< /Type /Pages /Kids [{kids}] /Count {len(page_texts)} >>"]
    for i, text in enumerate(page_texts):
        stream = _content(text, glued)
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R"
            f" /Resources << /Font << /F1 {font_id} 0 R >> >> >>"
        )
        objects.append(f"<< /Length {len(stream)} >>\nstream\n".encode() + stream + b"\nendstream")
    objects.append(
        f"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /FirstChar 32 /LastChar 126 /Widths [{widths}] >>"
    )
    return _serialise([o.encode() if isinstance(o, str) else o for o in objects])


def _serialise(objects: list[bytes]) -> bytes:
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offset:010d} 00000 n \n".encode() for offset in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\n".encode()
    return bytes(out + f"startxref\n{xref}\n%%EOF\n".encode())


def encrypt(pdf: bytes, user_password: str, owner_password: str) -> bytes:
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdf)))
    writer.encrypt(user_password, owner_password, algorithm="RC4-128")  # RC4 needs no extra deps
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


@pytest.fixture
def write(tmp_path):
    def _write(name: str, data: bytes | str) -> Path:
        path = tmp_path / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return path

    return _write


# -- PDFs -----------------------------------------------------------------------------------


def test_multi_page_pdf_text_and_spans(write):
    texts = ["Hello world, page one.\nSecond line.", "Page two text.", "Third page."]
    doc = load_document(write("book.pdf", make_pdf(texts)))
    assert doc.extractor == "pypdf"
    assert doc.total_pages == 3
    assert [doc.text[p.start : p.end] for p in doc.pages] == texts
    assert doc.text == "\n\n".join(texts)
    assert [p.label for p in doc.pages] == ["1", "2", "3"]
    assert doc.name == "book.pdf" and Path(doc.source).is_absolute()
    assert doc.sha256 == hashlib.sha256(doc.text.encode()).hexdigest()


def test_page_labels(write):
    labels = b"0 << /S /r >> 2 << /S /D /St 1 >> 3 << /P (A-) /S /D /St 5 >>"
    path = write("labels.pdf", make_pdf(["Title", "Preface", "Intro", "Appendix"], labels))
    assert [p.label for p in read_pdf(path).pages] == ["i", "ii", "1", "A-5"]


def test_page_at_maps_offsets_and_gaps(write):
    doc = load_document(write("p.pdf", make_pdf(["aaaa", "bbb", "cc"])))
    first, second, third = doc.pages
    assert doc.page_at(0) is first and doc.page_at(first.end - 1) is first
    # The "\n\n" between pages belongs to the page before it.
    assert doc.page_at(first.end) is first and doc.page_at(first.end + 1) is first
    assert doc.page_at(second.start) is second
    assert doc.page_at(len(doc.text)) is third
    for offset in (-1, len(doc.text) + 1):
        with pytest.raises(ValueError, match="outside"):
            doc.page_at(offset)


def test_blank_page_keeps_numbering(write):
    doc = read_pdf(write("blank.pdf", make_pdf(["one", "", "three"])))
    assert [p.number for p in doc.pages] == [1, 2, 3]
    assert doc.pages[1].start == doc.pages[1].end
    assert doc.page_at(doc.pages[2].start).number == 3


def test_image_only_pdf_needs_ocr(write):
    with pytest.raises(DocumentError, match="image-only.*ocrmypdf"):
        read_pdf(write("scan.pdf", make_pdf(["", ""])))


def test_zero_page_pdf(write):
    pdf = _serialise([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [] /Count 0 >>"])
    with pytest.raises(DocumentError, match="has no pages"):
        read_pdf(write("empty.pdf", pdf))


@pytest.mark.parametrize("data", [b"%PDF-1.4\n" + bytes(range(256)) * 4, b"%PDF-1.4\n1 0 obj\n<<"])
def test_corrupt_pdf(write, data):
    with pytest.raises(DocumentError, match="not a readable PDF"):
        load_document(write("broken.pdf", data))


def test_password_protected_pdf(write):
    path = write("secret.pdf", encrypt(make_pdf(["classified"]), "secret", "owner"))
    with pytest.raises(DocumentError, match="password-protected.*qpdf --decrypt"):
        read_pdf(path)


def test_owner_password_only_pdf_opens(write):
    path = write("locked.pdf", encrypt(make_pdf(["open to all readers"]), "", "owner"))
    assert read_pdf(path).text == "open to all readers"


def test_missing_crypto_dependency_is_named(write, monkeypatch):
    def needs_cryptography(self, password):
        raise DependencyError("cryptography is required for AES algorithm")

    monkeypatch.setattr(pypdf.PdfReader, "decrypt", needs_cryptography)
    path = write("aes.pdf", encrypt(make_pdf(["x"]), "", "owner"))
    with pytest.raises(DocumentError, match="pip install cryptography"):
        read_pdf(path)


def test_one_bad_page_is_skipped_with_a_warning(write, monkeypatch, caplog):
    extract_text = pypdf.PageObject.extract_text

    def flaky(self):
        text = extract_text(self)
        if text.startswith("bad"):
            raise KeyError("/Font")
        return text

    monkeypatch.setattr(pypdf.PageObject, "extract_text", flaky)
    with caplog.at_level(logging.WARNING, logger="semanticache_rag.documents"):
        doc = read_pdf(write("flaky.pdf", make_pdf(["good", "bad page", "fine"])))
    assert doc.text == "good\n\n\n\nfine" and doc.total_pages == 3
    assert any("page 2" in r.message for r in caplog.records)


def test_pdf_sniffed_by_content(write):
    doc = load_document(write("report.bin", make_pdf(["sniffed by its header"])))
    assert doc.extractor == "pypdf" and doc.text == "sniffed by its header"


def test_ligatures_normalised_in_pdf(write, monkeypatch):
    monkeypatch.setattr(pypdf.PageObject, "extract_text", lambda self: "ﬁne ﬂow\r\nnext\x00")
    assert read_pdf(write("lig.pdf", make_pdf(["x"]))).text == "fine flow\nnext"


# -- glued words ----------------------------------------------------------------------------


def _glued_pdf_lines() -> list[str]:
    return [" ".join(GLUED_WORDS[i : i + 8]) for i in range(0, len(GLUED_WORDS), 8)]


def test_glued_pdf_warns_without_pypdfium2(write, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pypdfium2", None)  # import now fails
    path = write("policy.pdf", make_pdf(["\n".join(_glued_pdf_lines())], glued=True))
    with caplog.at_level(logging.WARNING, logger="semanticache_rag.documents"):
        doc = read_pdf(path)
    assert doc.extractor == "pypdf" and "Thepackagemustbe" in doc.text
    assert any("glued" in r.message and "pip install pypdfium2" in r.message for r in caplog.records)


def test_glued_pdf_reextracted_with_pypdfium2(write):
    pytest.importorskip("pypdfium2")
    lines = _glued_pdf_lines()
    doc = read_pdf(write("policy.pdf", make_pdf(["\n".join(lines), "Short page."], glued=True)))
    assert doc.extractor == "pypdfium2"
    assert doc.text.split() == " ".join(lines + ["Short page."]).split()
    assert [p.number for p in doc.pages] == [1, 2]
    assert doc.text[doc.pages[1].start : doc.pages[1].end] == "Short page."


def test_glued_pdf_kept_when_pypdfium2_fails(write, monkeypatch, caplog):
    pytest.importorskip("pypdfium2")

    def broken(data):
        raise RuntimeError("pdfium exploded")

    monkeypatch.setattr(documents, "_pdfium_pages", broken)
    with caplog.at_level(logging.WARNING, logger="semanticache_rag.documents"):
        doc = read_pdf(write("policy.pdf", make_pdf(["\n".join(_glued_pdf_lines())], glued=True)))
    assert doc.extractor == "pypdf"
    assert any("pdfium exploded" in r.message for r in caplog.records)


def test_looks_glued_on_real_text():
    text = GPL3.read_text() if GPL3.exists() else PARAGRAPH * 20
    glued = "\n".join(line.replace(" ", "") for line in text.splitlines())
    assert not looks_glued(text)
    assert looks_glued(glued)
    assert not looks_glued(PARAGRAPH)
    assert looks_glued(PARAGRAPH.replace(" ", ""))


@pytest.mark.parametrize(
    "text",
    [
        "def getAbstractSingletonProxyFactoryBean(self):\n    return self._proxy_factory_bean\n" * 9,
        "See https://www.gnu.org/licenses/why-not-lgpl.html and https://example.org/"
        "averyveryverylongpathsegmentwithoutbreaks for details, or mail someone@example.com.\n" * 5,
        "短い日本語の文章には単語の間に空白がありませんが、これは正常な文章です。" * 20,
        "Internationalization",
    ],
)
def test_looks_glued_ignores_code_urls_and_cjk(text):
    assert not looks_glued(text)


# -- text -----------------------------------------------------------------------------------


def test_text_file(write):
    doc = load_document(write("notes.txt", "line one\r\nline two\n"))
    assert doc.text == "line one\nline two\n"
    assert doc.extractor == "text" and doc.name == "notes.txt"
    assert doc.pages == (Page(number=1, label="1", start=0, end=len(doc.text)),)


def test_markdown_file_given_as_str(write):
    path = write("README.md", "# Title\n\nSome *markdown*.\n")
    doc = load_document(str(path))
    assert doc.text.startswith("# Title") and doc.source == str(path.resolve())


def test_raw_string():
    doc = load_document("Just some text, not a file.")
    assert doc.name == "text" and doc.source is None and doc.extractor == "text"
    assert doc.total_pages == 1 and doc.page_at(3).number == 1


def test_document_returned_as_is():
    doc = document_from_text("abc", name="mine")
    assert load_document(doc) is doc and doc.name == "mine"


def test_ligatures_and_nul_normalised():
    doc = document_from_text("ﬁnd the ﬂag\x00 in ＡＢＣ\r\n")
    assert doc.text == unicodedata.normalize("NFKC", doc.text) == "find the flag in ABC\n"


@pytest.mark.parametrize("name", ["missing.pdf", "notes.TXT", "dir/README.md"])
def test_missing_path_is_an_error(name, tmp_path):
    with pytest.raises(DocumentError, match="no such file"):
        load_document(str(tmp_path / name))


def test_missing_pathlib_path_is_an_error(tmp_path):
    with pytest.raises(DocumentError, match="no such file"):
        load_document(tmp_path / "whatever")


def test_strings_naming_other_files_are_text_not_read(write):
    """Text from a user is never read from disk: only a document file name (.pdf, .txt, ...) is."""
    secret = write("id_rsa", "PRIVATE KEY")
    for text in (str(secret), "/etc/passwd", "~/.ssh/id_rsa"):
        doc = load_document(text)
        assert doc.text == text and doc.source is None
    assert load_document(secret).text == "PRIVATE KEY"  # a Path is read


def test_path_like_strings_with_newlines_are_text():
    assert load_document("see\nmissing.pdf").text == "see\nmissing.pdf"


def test_non_utf8_text_file(write):
    path = write("latin1.txt", "café au lait".encode("latin-1"))
    with pytest.raises(DocumentError, match=r"latin1\.txt is not valid UTF-8.*save it as UTF-8"):
        load_document(path)


def test_binary_file_names_supported_formats(write):
    with pytest.raises(DocumentError, match=r"not a supported format.*PDF.*\.txt"):
        load_document(write("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"))


def test_unknown_suffix_utf8_is_text(write):
    assert load_document(write("notes.log", "plain words")).text == "plain words"


@pytest.mark.parametrize("content", ["", " \n\t\n", "\x00\x00"])
def test_empty_document(write, content):
    with pytest.raises(DocumentError, match="document is empty"):
        load_document(write("empty.txt", content))
    with pytest.raises(DocumentError, match="document is empty"):
        document_from_text(content)


def test_directory_is_an_error(tmp_path):
    with pytest.raises(DocumentError, match="is a directory"):
        load_document(tmp_path)


def test_document_is_frozen():
    doc = document_from_text("abc")
    with pytest.raises(AttributeError):
        doc.text = "changed"  # type: ignore[misc]
    assert isinstance(doc, Document)
