"""Chats from the standard library's own docstrings, for the README's SmolLM2 fine-tune:
"What does `json.dumps` do in Python?" -> the first paragraph of its docstring. Functions,
classes and their methods; about 1 in 10 of them (by a hash of the name) go to val.jsonl, so
that it asks about functions training never saw. No dependencies.

    python benchmarks/docstring_chats.py train.jsonl val.jsonl
"""

import hashlib
import importlib
import inspect
import json
import re
import sys

MODULES = """os os.path json re itertools collections collections.abc functools pathlib string math
cmath datetime textwrap shutil random statistics heapq bisect operator difflib fnmatch glob
tempfile subprocess csv io time calendar hashlib hmac base64 binascii copy pickle shelve inspect
typing types abc numbers urllib.parse urllib.request zipfile tarfile gzip bz2 lzma zlib argparse
configparser shlex logging threading queue asyncio concurrent.futures multiprocessing socket
selectors signal struct array decimal fractions uuid enum dataclasses contextlib ast tokenize dis
unicodedata codecs pprint reprlib sqlite3 html html.parser email.message email.utils http.client
http.server http.cookies mimetypes ipaddress smtplib ftplib xml.etree.ElementTree xml.dom.minidom
plistlib traceback warnings weakref gc secrets locale platform sysconfig importlib
importlib.metadata pkgutil timeit tracemalloc unittest doctest filecmp fileinput linecache stat
graphlib zoneinfo mailbox optparse getopt gettext imaplib poplib socketserver ssl select resource
pty tty termios fcntl pwd grp ctypes pydoc pdb bdb cmd code codeop symtable keyword pyclbr
py_compile compileall zipapp runpy sched contextvars wave colorsys quopri netrc cProfile pstats
trace faulthandler atexit copyreg marshal dbm xml.sax xmlrpc.client wsgiref.simple_server sys
builtins""".split()
QUESTIONS = ["What does `{}` do in Python?", "Explain `{}` in Python.", "What is `{}` for?"]


def first_paragraph(obj):
    """The docstring's first paragraph on one line, past a "name(args) -> result" line."""
    for para in re.split(r"\n\s*\n", inspect.getdoc(obj) or ""):
        text = " ".join(para.split()).rstrip(" \\")  # (some end a line with a backslash)
        if not re.fullmatch(r"[\w.]+\(.*\)( *-+> *.*)?", text):
            return text
    return ""


def documented():
    """(qualified name, object): each module's public functions and classes (those it defines
    or lists in __all__), and the public methods those classes define."""
    for modname in MODULES:
        module = importlib.import_module(modname)
        public = getattr(module, "__all__", None)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
                continue
            if name not in (public or ()) and getattr(obj, "__module__", None) not in (
                modname,
                "_" + modname,
            ):
                continue  # imported from elsewhere
            prefix = "" if modname == "builtins" else modname + "."  # `len`, not `builtins.len`
            yield f"{prefix}{name}", obj
            for mname, method in sorted(vars(obj).items()) if inspect.isclass(obj) else ():
                if not mname.startswith("_") and inspect.isroutine(method):
                    yield f"{prefix}{name}.{mname}", method


def main(train_path="train.jsonl", val_path="val.jsonl"):
    answers, counts = set(), [0, 0]
    with open(train_path, "w") as train, open(val_path, "w") as val:
        for name, obj in documented():
            answer = first_paragraph(obj)
            if not 40 <= len(answer) <= 800 or answer in answers:
                continue  # too short or long, or a doc shared with another name
            answers.add(answer)
            h = int(hashlib.sha256(name.encode()).hexdigest(), 16)
            question = QUESTIONS[h % len(QUESTIONS)].format(name)
            chat = {
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            }
            is_val = h % 10 == 0
            (val if is_val else train).write(json.dumps(chat) + "\n")
            counts[is_val] += 1
    print(f"{counts[0]} chats in {train_path}, {counts[1]} in {val_path}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
