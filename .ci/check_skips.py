"""Fail CI when any test was skipped other than the CUDA tests (no GPU on CI machines).

Reads the JUnit XML that .ci/run asks pytest for. A skip elsewhere means a dependency or a
server the suite needs was missing, and a green run would not mean what it says.
"""

import sys
import xml.etree.ElementTree as ET

ALLOWED = ("tests.test_cuda", "tests.test_cuda_snapshot")  # modules whose tests need a CUDA device


def main(path: str) -> int:
    skipped = []
    for case in ET.parse(path).getroot().iter("testcase"):
        skip = case.find("skipped")
        if skip is not None and not case.get("classname", "").startswith(ALLOWED):
            skipped.append(f"{case.get('classname')}::{case.get('name')}: {skip.get('message', '')}")
    if skipped:
        print(f"{len(skipped)} test(s) skipped outside the CUDA tests:\n" + "\n".join(skipped), file=sys.stderr)
        return 1
    print("no skips outside the CUDA tests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
