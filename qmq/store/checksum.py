"""The checksums of the log store and the delay server's files: CRC-32 (IEEE, zlib's polynomial) and
Adler-32, from zlib-ng. Its CRC folds with the CPU's carry-less multiply: on a 1 KiB record it takes
a sixth of zlib's time, and on a replica's 256 KiB chunk a twentieth (docs/benchmarks.md), which
every append, replica check and scrub pays. The values are zlib's exactly, so files written by
either are read by either.
"""

from zlib_ng.zlib_ng import adler32, crc32

__all__ = ["adler32", "crc32"]
