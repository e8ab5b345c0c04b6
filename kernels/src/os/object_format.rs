//! A plugin library is checked before the dynamic loader maps it: that it is a shared library
//! in the platform's object format, and that everything its headers point at lies inside the
//! file. The loader trusts those headers: for a truncated copy it maps pages past the end of
//! the file, and the first touch of them kills the whole process (SIGBUS on Linux) before any
//! error can be printed. goblin reads all three formats, so each is checked (and tested) on
//! any machine.

use goblin::elf::program_header::pt_to_str;
use goblin::elf::section_header::SHT_NOBITS;
use goblin::elf::Elf;
use goblin::mach::{Mach, MachO};
use goblin::pe::PE;

/// An object format of shared libraries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Linux and the other Unix systems: `.so`.
    Elf,
    /// macOS: `.dylib`.
    MachO,
    /// Windows: `.dll`.
    Pe,
}

impl Format {
    /// The format this platform's loader reads.
    pub const NATIVE: Format = if cfg!(target_os = "macos") {
        Format::MachO
    } else if cfg!(windows) {
        Format::Pe
    } else {
        Format::Elf
    };

    pub fn name(self) -> &'static str {
        match self {
            Format::Elf => "ELF",
            Format::MachO => "Mach-O",
            Format::Pe => "PE",
        }
    }

    /// Whether `bytes` start as a file of this format does.
    fn has_header(self, bytes: &[u8]) -> bool {
        match self {
            Format::Elf => bytes.starts_with(b"\x7fELF"),
            // 32- and 64-bit, either byte order, and universal ("fat") files.
            Format::MachO => {
                bytes.len() >= 4 && {
                    let magic = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
                    matches!(magic, 0xfeed_face | 0xfeed_facf | 0xcefa_edfe | 0xcffa_edfe | 0xbeba_feca | 0xcafe_babe)
                }
            }
            Format::Pe => bytes.starts_with(b"MZ"),
        }
    }
}

/// Why a file cannot be loaded as a plugin library.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The file does not start as the format's files do.
    NoHeader(Format),
    /// It does, but is not a shared library, or its headers point past its end.
    Damaged(String),
}

/// Checks `bytes` (a whole file) as a shared library of this platform's format.
pub fn check_native(bytes: &[u8]) -> Result<(), Refusal> {
    check(bytes, Format::NATIVE)
}

/// Checks `bytes` (a whole file) as a shared library of `format`.
pub fn check(bytes: &[u8], format: Format) -> Result<(), Refusal> {
    if !format.has_header(bytes) {
        return Err(Refusal::NoHeader(format));
    }
    match format {
        Format::Elf => check_elf(bytes),
        Format::MachO => check_mach(bytes),
        Format::Pe => check_pe(bytes),
    }
    .map_err(Refusal::Damaged)
}

/// `what` needs bytes `offset..offset + size`: an error unless the file has them.
fn inside(len: u64, offset: u64, size: u64, what: impl FnOnce() -> String) -> Result<(), String> {
    match offset.checked_add(size) {
        Some(end) if end <= len => Ok(()),
        _ => Err(format!(
            "truncated: {} needs bytes {offset}..{} but the file has {len}",
            what(),
            offset.saturating_add(size)
        )),
    }
}

fn check_elf(bytes: &[u8]) -> Result<(), String> {
    let len = bytes.len() as u64;
    let elf = Elf::parse(bytes).map_err(|e| format!("a damaged or truncated ELF file ({len} bytes): {e}"))?;
    if elf.header.e_type != goblin::elf::header::ET_DYN {
        return Err(format!(
            "an ELF file of type {}, not a shared library",
            goblin::elf::header::et_to_str(elf.header.e_type)
        ));
    }
    for (i, segment) in elf.program_headers.iter().enumerate() {
        inside(len, segment.p_offset, segment.p_filesz, || format!("segment {i} ({})", pt_to_str(segment.p_type)))?;
    }
    for section in elf.section_headers.iter().filter(|s| s.sh_type != SHT_NOBITS) {
        let name = || format!("section {}", elf.shdr_strtab.get_at(section.sh_name).unwrap_or("?"));
        inside(len, section.sh_offset, section.sh_size, name)?;
    }
    Ok(())
}

fn check_mach(bytes: &[u8]) -> Result<(), String> {
    let len = bytes.len() as u64;
    let damaged = |e: goblin::error::Error| format!("a damaged or truncated Mach-O file ({len} bytes): {e}");
    match Mach::parse(bytes).map_err(damaged)? {
        Mach::Binary(macho) => check_macho(&macho, bytes, 0),
        Mach::Fat(fat) => {
            for (i, arch) in fat.iter_arches().enumerate() {
                let arch = arch.map_err(damaged)?;
                inside(len, arch.offset as u64, arch.size as u64, || format!("architecture {i}"))?;
                let slice = &bytes[arch.offset as usize..(arch.offset + arch.size) as usize];
                check_macho(&MachO::parse(slice, 0).map_err(damaged)?, slice, arch.offset as u64)?;
            }
            Ok(())
        }
    }
}

/// One architecture's image, `at` bytes into the file.
fn check_macho(macho: &MachO, image: &[u8], at: u64) -> Result<(), String> {
    use goblin::mach::header::{filetype_to_str, MH_BUNDLE, MH_DYLIB};
    if !matches!(macho.header.filetype, MH_DYLIB | MH_BUNDLE) {
        return Err(format!("a Mach-O file of type {}, not a dynamic library", filetype_to_str(macho.header.filetype)));
    }
    let len = image.len() as u64;
    for segment in macho.segments.iter() {
        let name = || format!("segment {}", segment.name().unwrap_or("?"));
        inside(len, segment.fileoff, segment.filesize, name).map_err(|e| {
            if at > 0 {
                format!("{e} (at {at})")
            } else {
                e
            }
        })?;
    }
    Ok(())
}

fn check_pe(bytes: &[u8]) -> Result<(), String> {
    let len = bytes.len() as u64;
    let pe = PE::parse(bytes).map_err(|e| format!("a damaged or truncated PE file ({len} bytes): {e}"))?;
    if !pe.is_lib {
        return Err("a PE file that is not a DLL".into());
    }
    for section in &pe.sections {
        let name = || format!("section {}", section.name().unwrap_or("?"));
        inside(len, section.pointer_to_raw_data as u64, section.size_of_raw_data as u64, name)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64-bit little-endian Mach-O header of `filetype` with one LC_SEGMENT_64 whose file
    /// range is `fileoff..fileoff + filesize`, followed by `tail` bytes.
    fn mach_o(filetype: u32, fileoff: u64, filesize: u64, tail: usize) -> Vec<u8> {
        let mut b = Vec::new();
        for v in [0xfeed_facfu32, 0x0100_000c, 0, filetype, 1, 72, 0, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&0x19u32.to_le_bytes()); // LC_SEGMENT_64
        b.extend_from_slice(&72u32.to_le_bytes());
        b.extend_from_slice(b"__TEXT\0\0\0\0\0\0\0\0\0\0");
        for v in [0u64, 0x1000, fileoff, filesize] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [5u32, 5, 0, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.resize(b.len() + tail, 0);
        b
    }

    /// A PE file: the DOS stub's pointer, "PE\0\0", a COFF header with `characteristics` and no
    /// optional header, and one section whose raw data is `offset..offset + size`, followed by
    /// `tail` bytes.
    fn pe(characteristics: u16, offset: u32, size: u32, tail: usize) -> Vec<u8> {
        let mut b = vec![0u8; 0x80];
        b[..2].copy_from_slice(b"MZ");
        b[0x3c..0x40].copy_from_slice(&0x80u32.to_le_bytes());
        b.extend_from_slice(b"PE\0\0");
        for v in [0x8664u16, 1] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&[0u8; 12]);
        for v in [0u16, characteristics] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(b".text\0\0\0");
        for v in [size, 0x1000, size, offset, 0, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&[0u8; 4]);
        b.extend_from_slice(&0x6000_0020u32.to_le_bytes());
        b.resize(b.len() + tail, 0);
        b
    }

    const DLL: u16 = 0x2000 | 0x0002;

    #[test]
    fn each_format_refuses_a_file_without_its_header() {
        let text = b"#!/bin/sh\necho not a library\n";
        for format in [Format::Elf, Format::MachO, Format::Pe] {
            assert_eq!(check(text, format), Err(Refusal::NoHeader(format)));
        }
        assert_eq!(check(&mach_o(6, 0, 64, 64), Format::Elf), Err(Refusal::NoHeader(Format::Elf)));
        assert_eq!(check(&pe(DLL, 0x200, 16, 0x300), Format::MachO), Err(Refusal::NoHeader(Format::MachO)));
    }

    #[test]
    fn a_mach_o_dylib_or_bundle_passes_and_an_executable_does_not() {
        let dylib = mach_o(6, 0, 64, 64);
        assert_eq!(check(&dylib, Format::MachO), Ok(()));
        assert_eq!(check(&mach_o(8, 0, 64, 64), Format::MachO), Ok(()));
        let Err(Refusal::Damaged(why)) = check(&mach_o(2, 0, 64, 64), Format::MachO) else { panic!() };
        assert!(why.contains("type EXECUTE") && why.contains("not a dynamic library"), "{why}");
    }

    #[test]
    fn a_truncated_mach_o_is_refused_with_its_size() {
        let file = mach_o(6, 0, 4096, 64);
        for cut in [&file[..], &file[..20]] {
            let Err(Refusal::Damaged(why)) = check(cut, Format::MachO) else { panic!() };
            let size = format!("({} bytes)", cut.len());
            assert!(why.contains("damaged or truncated Mach-O file") && why.contains(&size), "{why}");
        }
    }

    #[test]
    fn a_pe_dll_passes_and_an_executable_does_not() {
        assert_eq!(check(&pe(DLL, 0x200, 16, 0x300), Format::Pe), Ok(()));
        let Err(Refusal::Damaged(why)) = check(&pe(0x0002, 0x200, 16, 0x300), Format::Pe) else { panic!() };
        assert!(why.contains("not a DLL"), "{why}");
    }

    #[test]
    fn a_truncated_pe_names_the_section_past_its_end() {
        let Err(Refusal::Damaged(why)) = check(&pe(DLL, 0x200, 0x4000, 0x300), Format::Pe) else { panic!() };
        assert!(why.contains("truncated: section .text needs bytes 512..16896"), "{why}");
    }

    #[test]
    fn this_platforms_format_is_its_loaders() {
        let expected = if cfg!(target_os = "macos") {
            Format::MachO
        } else if cfg!(windows) {
            Format::Pe
        } else {
            Format::Elf
        };
        assert_eq!(Format::NATIVE, expected);
    }
}
