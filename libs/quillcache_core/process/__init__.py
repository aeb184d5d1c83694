"""What every process is built from: its settings (flags and QC_* variables), logging and run loop, metrics, heap settling."""
