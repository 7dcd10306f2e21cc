"""qmq: reliable, database-backed messaging for Python services.

A message that a business transaction commits is delivered; one that it rolls back never exists.
See DESIGN.md (shared) and README.md for the architecture; this package holds the library and the servers.
"""

__version__ = "0.1.0"
