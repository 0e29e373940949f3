"""Execute notebooks in-process and store their outputs (text and PNG figures).

The GPU machine has no Jupyter kernel; this runs each code cell with exec() in
one namespace, which is all our notebooks need, and writes the outputs into the
.ipynb JSON. Usage: python notebooks/execute.py NOTEBOOK [...] --out-dir DIR
"""
import argparse
import base64
import contextlib
import io
import json
import os
import pathlib
import sys
import traceback

os.environ.setdefault("MPLBACKEND", "Agg")


def run(path: pathlib.Path, out_dir: pathlib.Path) -> bool:
    import matplotlib.pyplot as plt

    nb = json.loads(path.read_text())
    ns = {"__name__": "__main__"}
    ok, count = True, 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        count += 1
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        buf = io.StringIO()
        outputs = []
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(src, f"{path.name}[{count}]", "exec"), ns)
        except Exception as e:  # keep going: record the error in the notebook like Jupyter
            ok = False
            outputs.append({"output_type": "error", "ename": type(e).__name__, "evalue": str(e),
                            "traceback": traceback.format_exc().splitlines()})
        if buf.getvalue():
            outputs.insert(0, {"output_type": "stream", "name": "stdout", "text": buf.getvalue()})
        for num in plt.get_fignums():
            png = io.BytesIO()
            plt.figure(num).savefig(png, format="png", dpi=100, bbox_inches="tight")
            outputs.append({"output_type": "display_data", "metadata": {},
                            "data": {"image/png": base64.b64encode(png.getvalue()).decode(), "text/plain": "<Figure>"}})
        plt.close("all")
        cell["outputs"], cell["execution_count"] = outputs, count
        print(f"{path.name} cell {count}: {'ok' if ok else 'ERROR'}", file=sys.stderr, flush=True)
    (out_dir / path.name).write_text(json.dumps(nb, indent=1) + "\n")
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--out-dir", required=True)
    a = p.parse_args()
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {n: run(pathlib.Path(n), out) for n in a.notebooks}
    print(json.dumps(results))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
