"""The ground floor: errors that mean "the input is wrong", checks of single values, files written
whole, where relative paths point, which process speaks, and the scripts' one-line error handling.
Imports nothing else of lm."""
