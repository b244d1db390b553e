"""Thin command modules: parse, call one library function, render."""
