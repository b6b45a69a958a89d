"""The benchmark gallery: entries (the reference table's rows and their proxies), results, and the report rendered
from them (moelab.gallery.entries); which records are current (current), what a record ran (records), the
planned-vs-measured memory table (memory) and the step-time tables (speed).

    from moelab import gallery
    gallery.load_entries()                      # every entry in gallery/entries/*.yaml
    gallery.run_entry("tiny-cpu", steps=20)     # -> gallery/results/tiny-cpu--moelab.json
    gallery.render_report()                     # -> gallery/README.md and gallery/*.png
"""
from moelab.gallery.entries import (LAYOUT_KEYS, MEMORY_TARGET, RESULT_FIELDS, Entry, GalleryError, add_arguments,
                                    default_root, entry_result, get_entry, hardware_check, hardware_need,
                                    load_entries, load_results, main, render_report, run_entry)

__all__ = ["LAYOUT_KEYS", "MEMORY_TARGET", "RESULT_FIELDS", "Entry", "GalleryError", "add_arguments", "default_root",
           "entry_result", "get_entry", "hardware_check", "hardware_need", "load_entries", "load_results", "main",
           "render_report", "run_entry"]
