"""The SDK's version, in a module of its own so the SDK's modules can read it without importing the
package that imports them."""

__version__ = "0.1.0"
