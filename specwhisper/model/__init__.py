"""The Whisper network: encoder-decoder, checkpoint loading, output heads, CPU encoder fast path."""
