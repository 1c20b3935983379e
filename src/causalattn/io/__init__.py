"""What every layer above may use to take things from outside and run them apart.

files     the one reader of files someone hands in (arrays, JSON, Python source, text:
          headers first, one budget, nothing executed); AuditInputError, its refusal
runner    the one isolation runner for code causalattn executes (its own session, a
          deadline, memory and output caps, a typed Failure)

Below ``trace`` (``Trace.load`` reads with ``files``) and above only ``memory``, so nothing
here imports the rest of the package.
"""
