"""What every command pays before its work: the start-up shortcuts keep what they stand in for.

cffi parses each of wgpu-py's C type names against only the typedefs the name holds
(:func:`platforms.wgpu_native._parse_types_quickly`, half a second of every process that opens a
device); the size check of a store leaves ``torch._dynamo`` unimported (tests/test_op_bounds.py).
"""

import subprocess
import sys
import textwrap

import pytest


def test_wgpu_type_names_parse_as_cffi_parses_them():
    """Typedefs of wgpu's header (every 7th), bare, as a pointer and as a const pointer, parse to the same
    cffi type quickly as with cffi's own parse (run in a fresh process: the shortcut is installed
    once per process, and cffi caches what it parsed)."""
    pytest.importorskip("wgpu")
    code = textwrap.dedent('''
        import cffi.cparser
        from wgpu.backends.wgpu_native._ffi import ffi
        from tapml.platforms.wgpu_native import _parse_types_quickly
        own = cffi.cparser.Parser.parse_type_and_quals
        _parse_types_quickly()
        parser = ffi._parser
        assert parser.parse_type_and_quals is not own and parser._tapml_quick_types
        names = [key[8:] for key in parser._declarations if key.startswith("typedef ")]
        assert len(names) > 300
        names = sorted(names)[::7]  # cffi's own parse takes 14 ms a name: every 7th
        forms = [form for name in names for form in (name, name + " *", "const " + name + " *")]
        differ = [form for form in forms if parser.parse_type_and_quals(form) != own(parser, form)]
        assert not differ, differ[:5]
        for bad in ("WGPUNoSuchThing *", "struct {", "int int"):  # cffi's own errors, as before
            try:
                parser.parse_type_and_quals(bad)
                raise SystemExit(f"{bad!r} parsed")
            except cffi.CDefError:
                pass
            except Exception as e:
                assert type(e).__module__.startswith(("cffi", "pycparser")), (bad, e)
        s = ffi.new("WGPULimits *")  # and wgpu-py's own use works
        assert ffi.typeof(s) is ffi.typeof("WGPULimits *")
        print("ok", len(forms))
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
