"""Cost of sealing manifest.json (format 7) against format 6, for a manifest of N data files.

Usage: python benchmarks/manifest_seal.py 131072   (the data files of a 65,536-rank save)
"""
import sys, time, json
from dataclasses import replace
from ckpt_integration.storage import checkpoint_dir as ckdir
from ckpt_integration.storage.checksum import check_sealed
n = int(sys.argv[1])
files = {f"__{r}_{i}.distcp": {"size": 123456789 + r} for r in range(n // 2) for i in range(2)}
files.update({".metadata": {"size": 17196851, "crc32": 12345}, "index.bin": {"size": 9999999, "crc32": 6789}})
m7 = ckdir.Manifest(files=files, step=100, commit_seq=3, commit_id="ab" * 16)
m6 = replace(m7, version=6)
def best(f, k=5):
    out = []
    for _ in range(k):
        t = time.perf_counter(); f(); out.append(time.perf_counter() - t)
    return min(out)
t6 = best(lambda: ckdir.manifest_json(m6).encode())
t7 = best(lambda: ckdir.manifest_json(m7).encode())
data7 = ckdir.manifest_json(m7).encode()
tc = best(lambda: check_sealed(data7, "m"))
tp = best(lambda: json.loads(data7))
print(f"{n} files, {len(data7)/2**20:.2f} MiB: write text v6 {t6*1e3:.1f} ms, v7 {t7*1e3:.1f} ms; check seals {tc*1e3:.2f} ms; json.loads {tp*1e3:.1f} ms")
